"""A placed subclass of nnx.Linear whose own code fails on a tp rank's pieces (flax's LoRALinear, whose
LoRA branch jaxdist does not split; a subclass reading a transposed kernel itself) failed with a bare
TypeError naming neither the layer nor the cause. Now one error names both."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh

from jaxdist.engine.run import Parallel, Units
from jaxdist.tp import plan as tp_plan


class TransposedLinear(nnx.Linear):
    """Reads its kernel itself, as [out, in], never calling super().__call__."""

    def __call__(self, x):
        return x @ self.kernel[...].T


class Block(nnx.Module):
    def __init__(self, up: type, rngs: nnx.Rngs):
        extra = {"lora_rank": 2} if up is nnx.LoRALinear else {}
        self.up = up(8, 8 if up is TransposedLinear else 16, rngs=rngs, **extra)
        self.down = nnx.Linear(8 if up is TransposedLinear else 16, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Net(nnx.Module):
    def __init__(self, up: type, rngs: nnx.Rngs):
        self.inp = nnx.Linear(6, 8, rngs=rngs)
        self.blocks = nnx.List([Block(up, rngs)])
        self.out = nnx.Linear(8, 4, rngs=rngs)


@pytest.mark.parametrize(
    "up, said",
    [
        (nnx.LoRALinear, "its own __call__ failed around super().__call__, whose result is this tp rank's slice"),
        (TransposedLinear, "its own __call__ failed before calling super().__call__"),
    ],
)
def test_a_subclass_whose_own_code_fails_on_a_ranks_pieces_is_named_with_the_cause(up, said):
    units = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=lambda m, h, b: jnp.mean((m.out(h) - b["y"]) ** 2))
    plan = tp_plan.TPPlan({"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row()})
    batch = {"x": np.ones((8, 6), np.float32), "y": np.ones((8, 4), np.float32)}
    with pytest.raises(ValueError, match=f"TPPlan: blocks/0/up \\({up.__name__}, a subclass of nnx.Linear\\)") as e:
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(Net(up, nnx.Rngs(0)), optax.sgd(0.1), units, batch)
    assert said in str(e.value)
