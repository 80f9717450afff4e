"""An optimizer whose state is not in the parameters' dtype: AdamW with its first moment in bfloat16
(`optax.adamw(mu_dtype=...)`, the trainer's `optim.mu_dtype`) beside float32 parameters. Every
strategy keeps each moment in the dtype `optimizer.init` gives it (sharded like its parameter, in the
canonical form too) and trains as one device does with the same optimizer."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import ODD_PLAN, ODD_UNITS, OddMLP, odd_batches, odd_loss
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Parallel
from jaxdist.pipeline.run import Pipelined

STEPS = 3


def optimizer():
    # the clip is active (support.models' MLP has gradient norms > 0.05): the norm must be the global one
    return optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.bfloat16))


def make():
    return OddMLP(nnx.Rngs(0), hidden=6, layers=4)  # 4 blocks: 2 pipeline stages of 2


@pytest.fixture(scope="module")
def one_device():
    return train_single_device(make, odd_loss, odd_batches(STEPS), optimizer())


STRATEGIES = {
    "ddp8": lambda: (DDP(cpu_mesh((8,), ("dp",))), odd_loss),
    "zero1-8": lambda: (DDP(cpu_mesh((8,), ("dp",)), zero1=True), odd_loss),
    "fsdp8": lambda: (Parallel(cpu_mesh((8,), ("fsdp",))), ODD_UNITS),
    "dp2xfsdp2xtp2": lambda: (Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=ODD_PLAN), ODD_UNITS),
    "pp2xdp4": lambda: (Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2), ODD_UNITS),
}


def moment_dtypes(opt_state) -> set:
    """The dtypes of every first moment (`mu`) in an optax state."""
    found = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        if any(getattr(k, "name", None) == "mu" for k in path):
            found.add(jnp.dtype(leaf.dtype))
    return found


# slow: fsdp8 (dp2xfsdp2xtp2 shards over fsdp too) and ddp8 (zero1-8 runs the same class, its moments sharded)
SLOW = {"fsdp8", "ddp8"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW else ()) for n in STRATEGIES])
def test_a_bfloat16_first_moment_stays_bfloat16_and_trains_as_one_device(one_device, name):
    strategy, loss = STRATEGIES[name]()
    run = strategy.prepare(make(), optimizer(), loss, odd_batches(1)[0])
    got = train(run, odd_batches(STEPS))
    state = got[3]
    bf16 = {jnp.dtype(jnp.bfloat16)}
    assert moment_dtypes(one_device.opt_state) == bf16  # the reference really keeps bfloat16 moments
    assert moment_dtypes(state.opt_state) == bf16
    canonical = run.canonical(state)
    assert moment_dtypes(canonical.opt_state) == bf16
    # a bfloat16 moment rounds the same update on every layout; a rank's gradient summed in another
    # order can move a moment across a rounding step (2^-8 of it), so the parameters agree to lr x 2^-7
    assert_same_training(got, one_device, atol=1e-4)
    back = run.from_canonical(canonical)
    for a, b in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(state.opt_state), strict=True):
        assert a.dtype == b.dtype and bool(jnp.array_equal(a, b))
