"""The GPT of `jaxdist.train.gpt`, tensor parallel: how its weights split over `tp`, and its
forward written with `jaxdist.tp`'s layers, on one rank's pieces (inside `shard_map`).

Splits: qkv is column parallel by heads (q, k and v each keep the same heads),
proj and out are row parallel, fc column parallel, the token embedding and
the head split the vocabulary; norms, row-parallel biases and the position
embedding are replicated. The math is the same as `GPT.__call__`, so a run
can be checked against the single-device model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdist import tp
from jaxdist.train.gpt import GPTConfig

EPS = 1e-6  # nnx.LayerNorm's default


@dataclasses.dataclass(frozen=True)
class Context:
    axis: str  # the tp mesh axis
    size: int
    backend: str | None = None
    sequence_parallel: bool = False


def check(cfg: GPTConfig, size: int) -> None:
    for name, value in (("n_heads", cfg.n_heads), ("d_ff", cfg.ff), ("vocab_size", cfg.vocab_size)):
        if value % size:
            raise ValueError(f"tensor parallelism over {size} ranks needs {name}={value} divisible by {size}")


def split_block(p: dict, rank: int, size: int) -> dict:
    """One rank's pieces of one block's parameters (a pure dict from `nnx.State.to_pure_dict()`)."""
    d = p["proj"]["kernel"].shape[0]
    f = p["fc"]["kernel"].shape[1]
    cols = lambda a, n: a[..., rank * n // size : (rank + 1) * n // size]
    rows = lambda a, n: a[rank * n // size : (rank + 1) * n // size]
    qkv_k = p["qkv"]["kernel"].reshape(d, 3, d)
    qkv_b = p["qkv"]["bias"].reshape(3, d)
    return {
        "ln1": dict(p["ln1"]),
        "qkv": {"kernel": cols(qkv_k, d).reshape(d, -1), "bias": cols(qkv_b, d).reshape(-1)},
        "proj": {"kernel": rows(p["proj"]["kernel"], d), "bias": p["proj"]["bias"]},
        "ln2": dict(p["ln2"]),
        "fc": {"kernel": cols(p["fc"]["kernel"], f), "bias": cols(p["fc"]["bias"], f)},
        "out": {"kernel": rows(p["out"]["kernel"], f), "bias": p["out"]["bias"]},
    }


def join_block(parts: list[dict]) -> dict:
    """The inverse of `split_block` over all ranks."""
    d = parts[0]["proj"]["kernel"].shape[1]
    cat = lambda key, name, axis: jnp.concatenate([p[key][name] for p in parts], axis=axis)
    qkv_k = jnp.concatenate([p["qkv"]["kernel"].reshape(d, 3, -1) for p in parts], axis=2).reshape(d, 3 * d)
    qkv_b = jnp.concatenate([p["qkv"]["bias"].reshape(3, -1) for p in parts], axis=1).reshape(-1)
    first = parts[0]
    return {
        "ln1": first["ln1"],
        "qkv": {"kernel": qkv_k, "bias": qkv_b},
        "proj": {"kernel": cat("proj", "kernel", 0), "bias": first["proj"]["bias"]},
        "ln2": first["ln2"],
        "fc": {"kernel": cat("fc", "kernel", 1), "bias": cat("fc", "bias", 0)},
        "out": {"kernel": cat("out", "kernel", 0), "bias": first["out"]["bias"]},
    }


def split_outer(p: dict, rank: int, size: int, tied: bool) -> tuple[dict, dict]:
    """One rank's embed unit (vocabulary rows of wte; wpe) and head unit (ln_f; vocabulary columns of head)."""
    v = p["wte"]["embedding"].shape[0]
    embed = {"wte": p["wte"]["embedding"][rank * v // size : (rank + 1) * v // size], "wpe": p["wpe"]["embedding"]}
    head = {"ln_f": dict(p["ln_f"])}
    if not tied:
        head["head"] = {
            "kernel": p["head"]["kernel"][:, rank * v // size : (rank + 1) * v // size],
            "bias": p["head"]["bias"][rank * v // size : (rank + 1) * v // size],
        }
    return embed, head


def join_outer(embeds: list[dict], heads: list[dict], tied: bool) -> dict:
    out = {
        "wte": {"embedding": jnp.concatenate([e["wte"] for e in embeds], axis=0)},
        "wpe": {"embedding": embeds[0]["wpe"]},
        "ln_f": heads[0]["ln_f"],
    }
    if not tied:
        out["head"] = {
            "kernel": jnp.concatenate([h["head"]["kernel"] for h in heads], axis=1),
            "bias": jnp.concatenate([h["head"]["bias"] for h in heads], axis=0),
        }
    return out


REPLICATED = ("ln1/", "ln2/", "proj/bias", "out/bias", "wpe", "ln_f/")


def replicated(name: str) -> bool:
    """Whether the piece named `name` (a path in a rank's unit) is the same on every tp rank."""
    return name.startswith(REPLICATED) or name in REPLICATED


def layer_norm(x, p):
    """nnx.LayerNorm's math (fast variance, epsilon 1e-6)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean), 0.0)
    return (x - mean) * jax.lax.rsqrt(var + EPS) * p["scale"] + p["bias"]


def _enter(x, ctx: Context):
    """Into a column-parallel layer: the whole sequence, replicated activations."""
    if ctx.sequence_parallel:
        return tp.gather_sequence(x, ctx.axis, ctx.backend)
    return tp.copy_to_tp(x, ctx.axis, ctx.backend)


def _seq_local(p, ctx: Context):
    """Replicated parameters applied to this rank's sequence chunk only (sequence parallelism):
    each rank's gradient covers its chunk, so backward sums them over `tp` (Megatron's
    all-reduce of sequence-parallel norm and bias gradients)."""
    if not ctx.sequence_parallel:
        return p
    return jax.tree.map(lambda a: tp.copy_to_tp(a, ctx.axis, ctx.backend), p)


def block(p: dict, x, ctx: Context, n_heads: int):
    local = _seq_local({"ln1": p["ln1"], "ln2": p["ln2"], "proj": p["proj"]["bias"], "out": p["out"]["bias"]}, ctx)
    p = {
        **p,
        "ln1": local["ln1"],
        "ln2": local["ln2"],
        "proj": {**p["proj"], "bias": local["proj"]},
        "out": {**p["out"], "bias": local["out"]},
    }
    b, t, d = x.shape
    h = _enter(layer_norm(x, p["ln1"]), ctx)
    t_full = h.shape[1]
    q, k, v = jnp.split(tp.column_linear(h, p["qkv"]["kernel"], p["qkv"]["bias"]), 3, axis=-1)
    heads = lambda a: a.reshape(b, t_full, n_heads // ctx.size, d // n_heads)
    att = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True).reshape(b, t_full, -1)
    sp = dict(backend=ctx.backend, sequence_parallel=ctx.sequence_parallel)
    x = x + tp.row_linear(att, p["proj"]["kernel"], ctx.axis, p["proj"]["bias"], **sp)
    h = _enter(layer_norm(x, p["ln2"]), ctx)
    f = jax.nn.gelu(tp.column_linear(h, p["fc"]["kernel"], p["fc"]["bias"]))
    return x + tp.row_linear(f, p["out"]["kernel"], ctx.axis, p["out"]["bias"], **sp)


def embed(p: dict, batch: dict, ctx: Context):
    tokens = batch["tokens"][:, :-1]
    x = tp.vocab_parallel_embed(tokens, p["wte"], ctx.axis, backend=ctx.backend) + p["wpe"][: tokens.shape[1]][None]
    if ctx.sequence_parallel:
        x = tp.split_sequence(x, ctx.axis, ctx.backend)
    return x


def head_loss(p: dict, embed_params: dict, x, batch: dict, ctx: Context):
    h = _enter(layer_norm(x, _seq_local(p["ln_f"], ctx)), ctx)
    if "head" in p:
        logits = tp.column_linear(h, p["head"]["kernel"], p["head"]["bias"])
    else:  # tied: this rank's vocabulary rows of the embedding
        logits = jnp.einsum("btd,vd->btv", h, embed_params["wte"])
    per_token = tp.vocab_parallel_cross_entropy(logits, batch["tokens"][:, 1:], ctx.axis, backend=ctx.backend)
    return per_token.mean()
