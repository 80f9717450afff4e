"""The plain single-device step every strategy on a one-device mesh is compared with, and readers of
what its compiled program moves or copies."""

import re
from collections import Counter

import jax
import numpy as np
import optax
from flax import nnx

from jaxdist.models.gpt import GPTConfig
from support.hlo_schedule import COLLECTIVES

GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
COPIES = ("concatenate", "dynamic-update-slice")  # how a flat communication buffer is filled


def token_batches(n: int, rows: int = 8) -> list[dict]:
    """`n` batches of `rows` sequences of GPT_CFG's length plus one (inputs and next-token targets)."""
    rng = np.random.default_rng(0)
    shape = (rows, GPT_CFG.seq_len + 1)
    return [{"tokens": rng.integers(0, GPT_CFG.vocab_size, shape).astype(np.int32)} for _ in range(n)]


def pure(params):
    """Parameters as a pure dict, whether a run returns an `nnx.State` or a dict."""
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def plain_sgd(model: nnx.Module, loss_fn, batches, lr: float):
    """Plain optax SGD under `jit`: `(losses, grad norms, final parameters as a pure dict)`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.sgd(lr)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    step = jax.jit(step)
    opt_state, losses, norms = optimizer.init(params), [], []
    for batch in batches:
        params, opt_state, loss, norm = step(params, opt_state, batch)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms, nnx.to_pure_dict(params)


def plain_compiled(model: nnx.Module, loss_fn, optimizer, batch) -> jax.stages.Compiled:
    """The plain train step (value_and_grad, then optax), state donated, compiled for `batch`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=0).lower((params, optimizer.init(params)), batch).compile()


def collectives(text: str) -> list[str]:
    """Every collective instruction of a compiled program's text (any computation, async pairs too)."""
    ops = "|".join(COLLECTIVES)
    return re.findall(rf"=\s*\S+\s+((?:{ops})(?:-start)?)\(", text)


def copies(text: str) -> Counter:
    """The result shapes of every concatenate and dynamic-update-slice (the instructions that fill a flat
    buffer), counted."""
    ops = "|".join(COPIES)
    return Counter(m.group(2) + " " + m.group(1) for m in re.finditer(rf"=\s*(\S+)\s+({ops})\(", text))


def step_bytes(compiled: jax.stages.Compiled) -> int:
    """Temporary plus argument bytes of a compiled step (what it holds at its peak, besides outputs
    that alias donated arguments)."""
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes
