"""Converting a TP x FSDP or a pipelined TP run to the canonical form (every checkpoint save does) moves
the fused q/k/v columns with an all-to-all, not a replicate-then-partition that XLA warns about."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh

from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, tp_plan_for
from jaxdist.pipeline.run import Pipelined

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
BATCH = {"tokens": np.zeros((16, 17), np.int32)}
WARNING = "Involuntary full rematerialization"

LAYOUTS = {
    "dp-fsdp-tp": lambda plan: Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=plan),
    "pp-dp-tp": lambda plan: Pipelined(cpu_mesh((2, 2, 2), ("pp", "dp", "tp")), plan=plan, microbatches=2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_canonical_conversion_needs_no_full_rematerialization(layout, capfd):
    model = GPT(CFG, nnx.Rngs(0))
    expected = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    run = LAYOUTS[layout](tp_plan_for(CFG)).prepare(model, optax.adam(1e-3), UNITS, BATCH)
    capfd.readouterr()
    canonical = jax.block_until_ready(run.canonical(run.state))
    err = capfd.readouterr().err
    assert WARNING not in err, err[:2000]
    # the values are the single-device model's, fused columns in its own order
    got = jax.tree.map(np.asarray, canonical.params)
    jax.tree.map(np.testing.assert_array_equal, got, expected)
