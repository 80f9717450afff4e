"""The pipeline's state (the engine's, with every block parameter also split over pp) converts to the
canonical form and back exactly; its canonical parameters are the run's own full parameters."""

import jax
import numpy as np
import optax
from support.layouts import PLAN, batches, make_model
from support.meshes import cpu_mesh

from jaxdist.models.gpt import UNITS
from jaxdist.pipeline.run import Pipelined


def test_pipeline_state_round_trips_through_the_canonical_form():
    data = batches(1)
    mesh = cpu_mesh((2, 2, 2), ("pp", "dp", "tp"))
    run = Pipelined(mesh, plan=PLAN, microbatches=2).prepare(make_model(), optax.adam(1e-2), UNITS, data[0])
    state, _ = run.step(run.state, data[0])
    canonical = run.canonical(state)
    full = jax.tree.leaves(run.params(state))
    for a, b in zip(jax.tree.leaves(canonical.params), full, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    back = run.from_canonical(canonical)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
