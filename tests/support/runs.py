"""Driving a prepared run through its steps, as the strategy tests do."""

from flax import nnx

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Parallel


def ddp_run(cfg: DDP, make_model, loss_fn, batches, optimizer):
    """DDP over `batches`: `(losses, params, run, state, metrics)`."""
    run = cfg.prepare(make_model(), optimizer, loss_fn, batches[0])
    state, losses, metrics = run.state, [], []
    for batch in batches:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append(m)
    return losses, run.params(state), run, state, metrics


def engine_run(strategy: Parallel, make_model, units, batches, optimizer):
    """The unit engine over `batches`: `(losses, pure params, run, state, metrics)`."""
    run = strategy.prepare(make_model(), optimizer, units, batches[0])
    state, losses, metrics = run.state, [], []
    for batch in batches:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append(m)
    return losses, nnx.to_pure_dict(run.params(state)), run, state, metrics


def train(run, batches):
    """A prepared run over `batches`: `(losses, pure params, grad norms, state)`, as `assert_same_training` reads it."""
    state, losses, norms = run.state, [], []
    for batch in batches:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return losses, nnx.to_pure_dict(run.params(state)), norms, state


def run_steps(run, batches, state=None):
    """A prepared run over `batches` from `state` (its initial state by default): `(state, losses)`."""
    state, losses = run.state if state is None else state, []
    for batch in batches:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
    return state, losses
