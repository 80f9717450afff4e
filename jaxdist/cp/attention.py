"""The model's own attention over the whole context: keys and values all-gathered over cp.

Inside `attention_over`, every call this thread makes to `jax.nn.dot_product_attention` (the
model's own, through any module's reference to it: `jaxdist.compat.routed`) runs
`_attention`: the local queries (this rank's two chunks) attend to the keys and values of every
cp rank, gathered along the sequence (tiled, in rank order: `layout.gathered_indices`), under one
boolean mask built from global token indices: `is_causal`, `local_window_size`, and the model's
own `mask` when it spans the whole sequence (built from batch arrays cp leaves whole, such as
document ids) or broadcasts. The call then goes to JAX's function unchanged. The gather's
backward is a reduce-scatter (its transpose), so each rank receives the gradient of its own keys
and values from every rank's queries. A mask over only the local tokens, an attention bias or
sequence lengths cannot be extended to the other ranks' keys: refused (at `prepare`, whose probe
trace `check_model` runs the model through the same function).

This is the all-gather variant of context parallelism (Llama 3's): one gather of K and V per
attention call (cheap with grouped-query attention: K/V have fewer heads than Q) instead of a ring
of cp - 1 exchanges overlapped with blockwise attention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jaxdist import comm
from jaxdist.compat import routed
from jaxdist.cp.batch import POSITIONS
from jaxdist.cp.layout import chunk_len, gathered_indices, local_indices, traced_local_indices

# JAX's function, held in a tuple: a module-level name bound to it would itself be routed
_JAX = (getattr(jax.nn.dot_product_attention, "_jaxdist_original", jax.nn.dot_product_attention),)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_context(x, axis: str, backend: str | None = None):
    """All-gather the sequence (dimension 1) over `axis`; backward reduce-scatters (sums) it back."""
    return comm.all_gather(x, axis, comm.token("cp"), axis=1, backend=backend)[0]


def _gather_fwd(x, axis, backend):
    return gather_context(x, axis, backend), None


def _gather_bwd(axis, backend, _, g):
    return (comm.reduce_scatter(g, axis, comm.token("cp"), op="sum", scatter_axis=1, backend=backend)[0],)


gather_context.defvjp(_gather_fwd, _gather_bwd)


@dataclasses.dataclass
class AttentionProbe:
    """What a probe trace saw: how many attention calls, and with which query and key lengths."""

    calls: int = 0
    shapes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Context:
    axis: str | None  # None: a probe trace outside shard_map (shapes only, as rank 0)
    cp: int
    length: int  # the whole sequence
    backend: str | None
    who: str
    probe: AttentionProbe | None


class _Current(threading.local):
    ctx: _Context | None = None


_current = _Current()


def _refuse(ctx: _Context, what: str, fix: str) -> None:
    raise ValueError(f"{ctx.who}: under context parallelism (cp={ctx.cp}) {what}; {fix}")


def _mask_over_context(ctx: _Context, mask, q_idx, k_idx):
    """The model's mask for the local queries and the gathered keys: rows and columns of a mask over
    the whole sequence picked by global index; a dimension of size 1 broadcasts."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.ndim < 4:  # as jax.nn.dot_product_attention reads it: leading dimensions of size 1
        mask = jnp.expand_dims(mask, tuple(range(4 - mask.ndim)))
    t = ctx.length
    if mask.ndim != 4 or mask.shape[2] not in (1, t) or mask.shape[3] not in (1, t):
        _refuse(
            ctx,
            f"the model passes jax.nn.dot_product_attention a mask of shape {tuple(mask.shape)}, which does not span "
            f"the whole sequence of {t} tokens, so it cannot say which of the other ranks' keys a query may see",
            "build the mask [batch, heads, queries, keys] over the whole sequence from batch arrays cp leaves whole "
            "(Parallel(cp_whole=...), e.g. 'segment_ids'), or pass is_causal / local_window_size instead",
        )
    if mask.shape[2] == t:
        mask = jnp.take(mask, q_idx, axis=2)
    if mask.shape[3] == t:
        mask = mask[..., k_idx]
    return mask


def _attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual: bool = False,
):
    ctx = _current.ctx
    if bias is not None:
        _refuse(ctx, "an attention bias over the local keys cannot reach the other ranks' keys", "drop bias or cp")
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        _refuse(
            ctx,
            "query/key sequence lengths count local tokens",
            "mark padding with document ids in a whole batch array (Parallel(cp_whole=...)) and a mask built from them",
        )
    if return_residual:
        _refuse(ctx, "return_residual is not supported", "call jax.nn.dot_product_attention without it")
    n_local = 2 * chunk_len(ctx.cp, ctx.length)
    if jnp.ndim(query) != 4 or query.shape[1] != n_local or key.shape[1] != n_local:
        _refuse(
            ctx,
            f"attention runs on queries {tuple(query.shape)} and keys {tuple(key.shape)}, not on this rank's "
            f"{n_local} tokens of the sequence [batch, {n_local}, heads, head_dim]",
            "call jax.nn.dot_product_attention on the block's own tokens (batched, sequence along dimension 1)",
        )
    if ctx.probe is not None:  # shapes only: every rank's keys as rank 0's
        ctx.probe.calls += 1
        ctx.probe.shapes.append((tuple(query.shape), tuple(key.shape)))
        keys, values = (jnp.concatenate([a] * ctx.cp, axis=1) for a in (key, value))
        q_idx = jnp.asarray(local_indices(0, ctx.cp, ctx.length))
    else:
        keys, values = (gather_context(a, ctx.axis, ctx.backend) for a in (key, value))
        q_idx = traced_local_indices(jax.lax.axis_index(ctx.axis), ctx.cp, ctx.length)
    k_idx = gathered_indices(ctx.cp, ctx.length)
    allowed = _mask_over_context(ctx, mask, q_idx, k_idx)
    q, k = q_idx[:, None], jnp.asarray(k_idx)[None, :]
    rules = []
    if is_causal:
        rules.append(k <= q)
    if local_window_size is not None:
        window = local_window_size
        left, right = (window, window) if isinstance(window, int) else window
        rules.append((q <= k + left) & (q >= k - right))
    for rule in rules:
        allowed = rule[None, None] if allowed is None else jnp.logical_and(allowed, rule[None, None])
    return _JAX[0](query, keys, values, mask=allowed, scale=scale, implementation=implementation)


@contextlib.contextmanager
def _active(ctx: _Context) -> Iterator[None]:
    before = _current.ctx
    _current.ctx = ctx
    try:
        if before is None:
            with routed(_JAX[0], _attention):
                yield
        else:
            yield
    finally:
        _current.ctx = before


def attention_over(axis: str, cp: int, length: int, backend: str | None = None, who: str = "cp"):
    """While inside (this thread, inside `shard_map` over `axis`), the model's attention calls see the
    whole context of `length` tokens (see above)."""
    return _active(_Context(axis, cp, length, backend, who, None))


def probe_attention(cp: int, length: int, who: str = "cp"):
    """`attention_over` for a trace outside `shard_map` (shapes only): yields the `AttentionProbe`."""
    probe = AttentionProbe()

    @contextlib.contextmanager
    def run():
        with _active(_Context(None, cp, length, None, who, probe)):
            yield probe

    return run()


def check_model(run_model: Callable, params, batch, cp: int, length: int, who: str) -> AttentionProbe:
    """Trace `run_model(params, batch)` (the model as on one device, on one cp rank's `batch` of avals)
    and refuse, naming the fix, a model cp would compute wrongly: one that never calls
    `jax.nn.dot_product_attention` (its attention could not see the other ranks' keys) or never reads
    `batch["positions"]` (it numbers the local tokens itself). The attention calls' own refusals
    (`_attention`) surface here too."""
    with probe_attention(cp, length, who) as probe:
        try:
            jaxpr = jax.make_jaxpr(run_model)(params, batch).jaxpr
        except (TypeError, ValueError) as e:
            if str(e).startswith((who, "TPPlan", "Parallel", "Pipelined")):  # jaxdist's own word on it
                raise
            raise _failed_on_a_rank(e, batch, cp, length, who, attended=bool(probe.calls)) from e
    if not probe.calls:
        raise ValueError(
            f"{who}: under context parallelism (cp={cp}) the model never calls jax.nn.dot_product_attention, so its "
            "attention would see only this rank's tokens; compute attention with jax.nn.dot_product_attention "
            "(the call cp routes over the whole context), or leave cp out"
        )
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    first = len(jax.tree.leaves(params))
    at = [i for i, (path, _) in enumerate(flat) if getattr(path[0], "key", None) == POSITIONS]
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
    used |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
    if not any(jaxpr.invars[first + i] in used for i in at):
        raise ValueError(
            f"{who}: under context parallelism (cp={cp}) each rank holds two chunks of the sequence, but the model "
            f"never reads batch['{POSITIONS}'] (each local token's global position), so it numbers its tokens "
            f"itself (arange) and would place them wrongly; read positions from batch['{POSITIONS}'] when present"
        )
    return probe


def _failed_on_a_rank(e: Exception, batch, cp: int, length: int, who: str, attended: bool) -> ValueError:
    """The model's own code failing on one cp rank's batch: which arrays cp cut and which it kept whole,
    and (where no attention ran before) that attention computed by hand cannot run under cp."""
    cut = sorted(k for k, v in batch.items() if k != POSITIONS and getattr(v, "ndim", 0) > 1 and v.shape[1] != length)
    whole = sorted(k for k, v in batch.items() if getattr(v, "ndim", 0) > 1 and v.shape[1] == length)
    hint = (
        "code mixing a whole array with a cut one (a loss weighting the cut labels by the whole segment_ids) "
        "must use cut arrays alone: leave the key out of cp_whole, or derive the weights from a cut array"
        if attended
        else "no jax.nn.dot_product_attention ran before it: attention computed by hand (for example flax's "
        "MultiHeadAttention with dropout) cannot see the other ranks' keys; use jax.nn.dot_product_attention"
    )
    cause = str(e).splitlines()[0] if str(e) else ""
    return ValueError(
        f"{who}: under context parallelism (cp={cp}) the model failed on one rank's batch ({type(e).__name__}: "
        f"{cause}). cp cuts each batch array whose dimension 1 is the sequence length {length} to this rank's "
        f"{2 * chunk_len(cp, length)} tokens ({', '.join(cut) or 'none'}) and keeps cp_whole's whole "
        f"({', '.join(whole) or 'none'}); {hint}"
    )
