"""The pipeline's state (the engine's, with every block parameter also split over pp) converts to the
canonical form and back exactly; its canonical parameters are the run's own full parameters."""

import dataclasses

import jax
import numpy as np
from flax import nnx
from support.meshes import cpu_mesh
from support.models import GPT_CFG, gpt_batches
from support.optimizers import adamw

from jaxdist.models.gpt import GPT, UNITS, tp_plan_for
from jaxdist.pipeline.run import Pipelined


def test_pipeline_state_round_trips_through_the_canonical_form():
    # interleaved virtual stages over pp x dp x tp with a tied head: the program of tests/pipeline/test_pipeline.py's
    # pp2xdp2xtp2-interleaved-v2-m4-tied parity case (the same model, optimizer and batch), compiled once per run
    cfg = dataclasses.replace(GPT_CFG, n_layers=4, tie_embeddings=True)
    data = gpt_batches(1)
    mesh = cpu_mesh((2, 2, 2), ("pp", "dp", "tp"))
    strategy = Pipelined(mesh, plan=tp_plan_for(cfg), microbatches=4, schedule="interleaved", virtual=2)
    run = strategy.prepare(GPT(cfg, nnx.Rngs(0)), adamw(), UNITS, data[0])
    state, _ = run.step(run.state, data[0])
    canonical = run.canonical(state)
    full = jax.tree.leaves(run.params(state))
    for a, b in zip(jax.tree.leaves(canonical.params), full, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    back = run.from_canonical(canonical)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
