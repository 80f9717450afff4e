"""A pipeline over blocks of different kinds: a Gemma whose local (sliding-window) and global layers
fall unevenly on the stages, each stage running its own layers' window and rotary base.

Four layers, global every third (local, local, global, local), a window of 4 over 16 tokens: pp=2
puts (local, local) and (global, local) on the two stages, the interleaved schedule's four virtual
stages one layer each. Every schedule (1F1B with kept and with recomputed activations, interleaved,
ZB-H1 with its split backward) over pp x dp is compared with a single-device run of the same model:
3 steps of SGD (exact in the gradient's scale) and the gradient norm of each, float32 tolerances
(`support.reference`). A run that gave every stage the first stage's code would train a different
model: the loss of the same Gemma with every layer global differs from the mixed one's by far more
than the tolerance (checked first, so the comparison can fail).
"""

import dataclasses

import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.models import gemma
from jaxdist.pipeline.run import Pipelined

T, VOCAB, ROWS, STEPS = 16, 64, 8, 3
CFG = dataclasses.replace(
    gemma.FLAVORS["tiny"], vocab_size=VOCAB, seq_len=T, n_layers=4, global_every=3, sliding_window=4
)
assert [CFG.is_global(i) for i in range(4)] == [False, False, True, False]
# the rotary bases differ too, so a stage with the wrong kind of layer is wrong in two ways
assert CFG.rope_theta_local != CFG.rope_theta_global


def make(cfg=CFG):
    return gemma.Gemma(cfg, nnx.Rngs(0))


def batches() -> list[dict]:
    rng = np.random.default_rng(4)
    return [{"tokens": rng.integers(0, VOCAB, (ROWS, T + 1)).astype(np.int32)} for _ in range(STEPS)]


BATCHES = batches()


@pytest.fixture(scope="module")
def reference():
    return train_single_device(make, gemma.next_token_loss, BATCHES, optax.sgd(0.5))


def test_the_layers_kinds_change_the_model(reference):
    every_global = dataclasses.replace(CFG, sliding_window=None)
    other = train_single_device(lambda: make(every_global), gemma.next_token_loss, BATCHES[:1], optax.sgd(0.5))
    assert abs(other.losses[0] - reference.losses[0]) > 1e-3 * abs(reference.losses[0])


@pytest.mark.parametrize(
    ("schedule", "virtual", "remat", "variants"),
    [
        # each stage runs its own kinds in the fast run as interleaved (a rank holding stages of both kinds); 1F1B
        # trains as one device there too (tests/pipeline/test_pipeline_odd_models.py's tied weight, pp2 x dp4)
        pytest.param("1f1b", 1, None, (0, 1), marks=pytest.mark.slow),
        # recomputed stages train as one device in the fast run too (tests/pipeline/test_pipeline.py's recompute cases)
        pytest.param("1f1b", 1, True, (0, 1), marks=pytest.mark.slow),
        ("interleaved", 2, None, (0, 0, 1, 0)),
        # ZB-H1's split backward trains as one device in the fast run in tests/pipeline/test_pipeline.py (pp4xdp2)
        pytest.param("zb-h1", 1, None, (0, 1), marks=pytest.mark.slow),
    ],
    ids=["1f1b-kept", "1f1b-recomputed", "interleaved", "zb-h1"],
)
def test_each_stage_runs_its_own_layers_kinds(reference, schedule, virtual, remat, variants):
    strategy = Pipelined(
        cpu_mesh((2, 2), ("pp", "dp")), microbatches=2, schedule=schedule, virtual=virtual, remat=remat
    )
    run = strategy.prepare(make(), optax.sgd(0.5), gemma.UNITS, BATCHES[0])
    assert run.stage_variants == variants
    assert_same_training(train(run, BATCHES), reference)


@pytest.mark.slow
def test_stage_kinds_with_tensor_parallelism(reference):
    """pp x dp x tp with the Gemma's TP plan: each stage's variant on its tp pieces."""
    mesh = cpu_mesh((2, 2, 2), ("pp", "dp", "tp"))
    strategy = Pipelined(mesh, plan=gemma.tp_plan_for(CFG), microbatches=2)
    run = strategy.prepare(make(), optax.sgd(0.5), gemma.UNITS, BATCHES[0])
    assert run.stage_variants == (0, 1)
    assert_same_training(train(run, BATCHES), reference)


def test_blocks_with_different_parameters_are_refused_by_name():
    """Blocks must hold the same parameters (the stages exchange one weight layout): a Gemma whose
    blocks differ in shape cannot be told apart by kind alone, and the error names the block."""
    model = make()
    block = gemma.GemmaBlock(dataclasses.replace(CFG, d_ff=CFG.d_ff * 2), 1, nnx.Rngs(1))
    model.blocks[1] = block
    strategy = Pipelined(cpu_mesh((2,), ("pp",)), microbatches=2)
    with pytest.raises(ValueError, match=r"block 1's parameters differ from block 0's"):
        strategy.prepare(model, optax.sgd(0.5), gemma.UNITS, BATCHES[0])
