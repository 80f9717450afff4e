"""Word between the processes of a multi-process run, through jax's key-value store (the coordination
service `jax.distributed.initialize` starts): what the hosts must agree on before they act, where a device
collective would hang on a disagreement instead of reporting it. Everything here is a no-op in one process."""

from __future__ import annotations

import json

import jax

from jaxdist.train.config import ConfigError


def store():
    """jax's key-value store client, or None (one process, or no distributed runtime)."""
    from jax._src import distributed

    return getattr(distributed.global_state, "client", None) if jax.process_count() > 1 else None


def say(key: str, value: str) -> None:
    """Set `key` (once: a key set already keeps its first value)."""
    client = store()
    if client is None:
        return
    try:
        client.key_value_set(key, value)
    except Exception:  # noqa: BLE001, S110 (set already, or the store is gone: the peers' word is still read)
        pass


def tell_peers(directory: str, key: str, value: str) -> dict[str, str]:
    """Set `directory + key` to `value` and return what the other processes have set under `directory`
    (by key, without waiting); empty in one process or when the store cannot be reached."""
    say(directory + key, value)
    client = store()
    if client is None:
        return {}
    try:
        found = {k.rsplit("/", 1)[-1]: v for k, v in client.key_value_dir_get(directory)}
    except Exception:  # noqa: BLE001 (the store is gone with the run: the process's own error is said)
        return {}
    return {k: v for k, v in found.items() if k != key}


def each_process(prefix: str, timeout_s: float) -> dict[int, str] | None:
    """Every process's value under `prefix` (`prefix + str(process)`), waiting up to `timeout_s` for each;
    None if one does not come in time (a peer gone)."""
    client = store()
    if client is None:
        return {}
    out = {}
    for p in range(jax.process_count()):
        try:
            out[p] = client.blocking_key_value_get(f"{prefix}{p}", int(timeout_s * 1000))
        except Exception:  # noqa: BLE001 (timed out: the peer is gone or stuck)
            return None
    return out


PER_PROCESS_KEYS = {"run.progress"}  # what each process may set its own way (a progress bar on one node)
_checks = 0


class ConfigMismatch(ConfigError):
    """Processes of one run started with different configs."""


def check_same_config(config: dict, timeout_s: float = 120.0) -> None:
    """Raise on every process if the processes' configs (as given, before paths are made absolute) differ,
    naming the keys: a node started with a stale file trained silently otherwise (another learning rate or
    seed on one process) or hung (another run.steps). A peer that does not report in `timeout_s` is left to
    the run's own deadlines."""
    if store() is None:
        return
    global _checks
    _checks += 1  # keys of their own for each run in these processes (a set key keeps its first value)
    mine = {k: v for k, v in _flat(config).items() if k not in PER_PROCESS_KEYS}
    say(f"jaxdist/config/{_checks}/{jax.process_index()}", json.dumps(mine, sort_keys=True, default=str))
    theirs = each_process(f"jaxdist/config/{_checks}/", timeout_s)
    if theirs is None:
        return
    for p, text in sorted(theirs.items()):
        other = json.loads(text)
        keys = sorted(k for k in set(mine) | set(other) if _text(mine.get(k)) != _text(other.get(k)))
        if keys:
            shown = "; ".join(f"{k}={mine.get(k)!r} here, {other.get(k)!r} there" for k in keys[:5])
            more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
            raise ConfigMismatch(
                f"process {jax.process_index()}'s config differs from process {p}'s: {shown}{more}; start every "
                "process of a run with the same config file and overrides"
            )


def _text(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
