"""Pipeline parallelism (`jaxdist.pipeline`) against a single-device optax run.

Each run is compared with `test_engine.reference`: the unmodified model, one
value_and_grad over the whole global batch, the same optax transformation,
5 steps, float32. Tolerances as the engine's (tests/support/reference.py: losses rtol
5e-6; parameters atol 1e-4 per element and 5e-7 on average): the pipeline
averages micro-batch means and data-rank means, which differ from the
reference's one mean by float32 rounding only (seen: losses 2e-7, parameters
7e-6 at most).

The cases cover pp=2 and pp=4, 1F1B, interleaved (v=2), GPipe and ZB-H1, 4 and 8
micro-batches, activations kept (the default) and recomputed (remat=True), the
GPT (tied and separate head) and a residual MLP, SGD (with the gradient norm)
and AdamW, and the pipeline composed with dp, fsdp and tp, at one compile each.
"""

import dataclasses
import re

import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import MLP_PLAN, MLP_UNITS, ResMLP, gpt_batches, mlp_batches, mlp_loss
from support.optimizers import adamw, path_optimizer
from support.reference import LOSS_RTOL, assert_params_close, train_single_device

from jaxdist.models.gpt import GPT, UNITS, GPTConfig, next_token_loss, tp_plan_for
from jaxdist.pipeline import schedule as ps
from jaxdist.pipeline.run import Pipelined

STEPS = 5
GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)


def pipeline_run(strategy, make_model, units, batches, optimizer, norms=None):
    """Losses and final parameters of `strategy` on `batches`; each step's gradient norm appended to `norms`."""
    run = strategy.prepare(make_model(), optimizer, units, batches[0])
    state, losses = run.state, []
    for batch in batches:
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
        if norms is not None:
            norms.append(float(metrics["grad_norm"]))
    return losses, nnx.to_pure_dict(run.params(state))


GPT_CASES = {
    # name: (mesh shape, axis names, tied head, Pipelined options)
    "pp4xdp2-1f1b-m8": ((4, 2), ("pp", "dp"), False, dict(microbatches=8)),
    "pp2xdp2xtp2-interleaved-v2-m4-tied": (
        (2, 2, 2),
        ("pp", "dp", "tp"),
        True,
        dict(microbatches=4, schedule="interleaved", virtual=2),
    ),
    "pp2xfsdp2xtp2-zbh1-m4": ((2, 2, 2), ("pp", "fsdp", "tp"), False, dict(microbatches=4, schedule="zb-h1")),
    "pp4xdp2-zbh1-m8-recompute": ((4, 2), ("pp", "dp"), True, dict(microbatches=8, schedule="zbh1", remat=True)),
}
# ~20-30 s each. ZB-H1 is fast in the MLP's case. The untied GPT under 1F1B trains as one device in the fast
# run in tests/strategies/test_strategies_in_mesh_context.py (pp2 x dp4) and the trainer's pp test below; pp=4
# and 8 micro-batches in the MLP's pp4xdp2 cases here.
SLOW_GPT_CASES = {"pp4xdp2-1f1b-m8", "pp2xfsdp2xtp2-zbh1-m4", "pp4xdp2-zbh1-m8-recompute"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_GPT_CASES else c for c in GPT_CASES]
)
def test_gpt_matches_single_device(case):
    shape, names, tie, options = GPT_CASES[case]
    cfg = dataclasses.replace(GPT_CFG, tie_embeddings=tie)

    def make():
        return GPT(cfg, nnx.Rngs(0))

    batches = gpt_batches(STEPS)
    ref_losses, ref_params, _, _ = train_single_device(make, next_token_loss, batches, adamw())
    strategy = Pipelined(cpu_mesh(shape, names), plan=tp_plan_for(cfg), **options)
    losses, params = pipeline_run(strategy, make, UNITS, batches, adamw())
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


MLP_CASES = {
    # name: (mesh shape, axis names, blocks, Pipelined options, optimizer)
    "pp2xdp4-1f1b-m4-adamw": ((2, 4), ("pp", "dp"), 4, dict(microbatches=4), adamw),
    "pp4xdp2-interleaved-v2-m8-clip-multi-transform": (
        (4, 2),
        ("pp", "dp"),
        8,
        dict(microbatches=8, schedule="interleaved", virtual=2),
        lambda: path_optimizer(0.5),
    ),
    "pp2xfsdp4-gpipe-m4-sgd": (
        (2, 4),
        ("pp", "fsdp"),
        2,
        dict(microbatches=4, schedule="gpipe"),
        lambda: optax.sgd(0.1),
    ),
    "pp2xdp4-1f1b-m4-recompute-sgd": (
        (2, 4),
        ("pp", "dp"),
        4,
        dict(microbatches=4, remat=True),
        lambda: optax.sgd(0.1),
    ),
    "pp4xdp2-zbh1-m4-sgd": ((4, 2), ("pp", "dp"), 4, dict(microbatches=4, schedule="zb-h1"), lambda: optax.sgd(0.1)),
    "pp2xdp2xtp2-interleaved-v2-m4-recompute-sgd": (
        (2, 2, 2),
        ("pp", "dp", "tp"),
        4,
        dict(microbatches=4, schedule="interleaved", virtual=2, remat=True, plan=MLP_PLAN),
        lambda: optax.sgd(0.1),
    ),
}


# 1F1B with AdamW is the fast run's for the GPT's blocks in tests/strategies/test_strategies_in_mesh_context.py
# (pipeline-explicit-same, pp2 x dp4) and interleaved under tp in the GPT's tied case above: slow here
SLOW_MLP_CASES = {"pp2xdp4-1f1b-m4-adamw", "pp2xdp2xtp2-interleaved-v2-m4-recompute-sgd"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_MLP_CASES else c for c in MLP_CASES]
)
def test_a_model_that_is_not_the_gpt_matches_single_device(case):
    shape, names, blocks, options, optimizer = MLP_CASES[case]

    def make():
        return ResMLP(nnx.Rngs(0), layers=blocks)

    batches = mlp_batches(STEPS)
    ref_losses, ref_params, ref_norms, _ = train_single_device(make, mlp_loss, batches, optimizer())
    norms = []
    strategy = Pipelined(cpu_mesh(shape, names), **options)
    losses, params = pipeline_run(strategy, make, MLP_UNITS, batches, optimizer(), norms)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)  # every gradient, before any optimizer
    assert_params_close(params, ref_params, atol=1e-5)


def test_each_tick_is_one_sendrecv_carrying_all_its_messages():
    """The step lowers one collective permute per distinct tick pattern, whose pairs are exactly that
    tick's sends (lone warm-up sends and cool-down receives included), and none other."""
    strategy = Pipelined(cpu_mesh((4,), ("pp",)), microbatches=4)
    batch = mlp_batches(1)[0]
    run = strategy.prepare(ResMLP(nnx.Rngs(0), layers=4), optax.sgd(0.1), MLP_UNITS, batch)
    text = run.step.lower(run.state, batch).as_text()
    lowered = re.findall(r"collective_permute.*?source_target_pairs = dense<(\[\[.*?\]\])>", text)
    pairs = [tuple(tuple(p) for p in eval(x)) for x in lowered]  # noqa: S307 (our own HLO text)
    # besides the ticks: the ring shifts that bring each block's pp pieces to its stage and back
    rings = {tuple((q, (q + s) % 4) for q in range(4)) for s in (1, 2, 3)}
    expected = sorted({t.perm() for t in run.table.ticks if t.perm()})
    assert sorted(p for p in pairs if p not in rings) == expected
    assert ((0, 1),) in pairs and ((3, 2),) in pairs  # a lone send of warm-up, a lone receive of cool-down


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for x in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                yield inner


def _find(jaxpr, name):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for inner in _sub_jaxprs(eqn):
            yield from _find(inner, name)


def test_stage_gradients_are_averaged_over_dp_inside_the_tick_loop():
    """The data-axis all-reduce of a rank's stage gradients runs in the tick of its last op (inside the
    scanned ticks, while later ranks still run the cool-down), not after the schedule."""
    import jax

    strategy = Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=4)
    batch = mlp_batches(1)[0]
    run = strategy.prepare(ResMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), MLP_UNITS, batch)
    closed = jax.make_jaxpr(run._step)(run.state, batch)
    (scan,) = list(_find(closed.jaxpr, "scan"))
    inside = [e for e in _find(scan.params["jaxpr"].jaxpr, "psum") if e.params["axes"] == ("dp",)]
    assert len(inside) == 1
    assert run.plan.done.sum(axis=0).tolist() == [1, 1]  # once per rank
    assert run.plan.done[:, 1].argmax() < run.plan.done[:, 0].argmax()  # the last stage finishes first


def test_each_rank_stores_a_pp_th_of_every_block_and_of_its_optimizer_state():
    """Blocks (and Adam's moments of them) are split over pp as well as ZeRO-1 over dp: a device
    holds 1/(pp x dp) of a block kernel; the embedding and head stay whole over pp."""
    mesh = cpu_mesh((4, 2), ("pp", "dp"))
    run = Pipelined(mesh, microbatches=4).prepare(
        ResMLP(nnx.Rngs(0), d=16, f=24, layers=4), optax.adamw(1e-3), MLP_UNITS, mlp_batches(1)[0]
    )
    for tree in (run.state.params, run.state.opt_state[0].mu):
        for i in range(4):
            for x in (tree["layers"][i]["up"]["kernel"], tree["layers"][i]["down"]["kernel"]):
                shard = x.addressable_shards[0].data
                assert shard.size * 8 == x.size, (x.shape, x.sharding.spec)
        inp = tree["inp"]["kernel"]  # (5, 16): 16 split over dp only
        assert inp.addressable_shards[0].data.size * 2 == inp.size


def test_bad_options_raise_clear_errors_before_tracing():
    mesh = cpu_mesh((2, 4), ("pp", "dp"))
    batch = mlp_batches(1)[0]
    with pytest.raises(ValueError, match="multiple of pp=2"):
        Pipelined(mesh, microbatches=3, schedule="interleaved", virtual=2)
    with pytest.raises(ValueError, match="needs a 'pp' axis of size >= 2"):
        Pipelined(cpu_mesh((8,), ("dp",)))
    with pytest.raises(ValueError, match=r"3 blocks do not split into pp \* virtual = 2 stages"):
        Pipelined(mesh).prepare(ResMLP(nnx.Rngs(0), layers=3), optax.sgd(0.1), MLP_UNITS, batch)
    with pytest.raises(ValueError, match="4 rows do not split into microbatches=8"):
        Pipelined(mesh, microbatches=8).prepare(ResMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), MLP_UNITS, batch)
    with pytest.raises(ValueError, match="has_aux=True"):
        units = dataclasses.replace(MLP_UNITS, has_aux=True)
        Pipelined(mesh).prepare(ResMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), units, batch)
    with pytest.raises(ValueError, match="a pipeline axis: jaxdist.pipeline.Pipelined"):
        from jaxdist.engine.run import Parallel

        Parallel(mesh)


def test_a_corrupted_table_is_rejected_before_tracing(monkeypatch):
    table = ps.one_f_one_b(2, 4)
    ticks = list(table.ticks)
    ticks[1] = dataclasses.replace(ticks[1], recvs=(None, None))
    corrupted = dataclasses.replace(table, ticks=tuple(ticks))
    monkeypatch.setattr(ps, "one_f_one_b", lambda pp, m: (ps.validate(corrupted), corrupted)[1])
    with pytest.raises(ps.ScheduleError, match="tick 1: rank 0 sends the activation of micro-batch 1"):
        Pipelined(cpu_mesh((2,), ("pp",)), microbatches=4)


# 1F1B's and ZB-H1's memory bound (and GPipe's growth): tests/pipeline/test_pipeline_activations.py


# over 20 s: with the slow tests, beside the trainer's whole loop with parallel.pp=2 over two processes
# (tests/train/test_multiprocess_loop_*.py); the fast run trains Pipelined as one device in this file
@pytest.mark.slow
def test_the_trainers_parallel_pp_trains_as_ddp_does(tmp_path):
    from support.trainer_runs import BASE

    from jaxdist.train import config as config_lib
    from jaxdist.train.trainer import train

    # test_train's settings (a 2-step warmup: the learning rate is not near zero in these 3 steps), so the
    # DDP run is the program of its plotted run, compiled once per test run
    base = [*BASE, "run.steps=3", "run.checkpoint_every=-1"]

    def load(name, *extra):
        return config_lib.load(None, [*base, f"run.out_dir={tmp_path / name}", *extra])

    ddp = train(load("ddp"))
    pipelined = train(load("pp", "parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"))  # pp2 x dp2 x tp2
    np.testing.assert_allclose(pipelined, ddp, rtol=1e-5)
    with pytest.raises(config_lib.ConfigError, match="parallel.pp=2: .*microbatches=3 must be a multiple of pp=2"):
        train(load("bad", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.microbatches=3"))


@pytest.mark.multigpu
@pytest.mark.parametrize("delay_us", [0, 300], ids=["no-delay", "delay"])
def test_nccl_pipeline_on_two_gpus_matches_xla_and_one_device(delay_us):
    """pp=2 over two GPUs: every tick's sendrecv a real NCCL group (with a delay before each NCCL op,
    a read of a message before it arrived would give wrong numbers), against the xla backend and a
    single-device run."""
    import jax
    from jax.sharding import AxisType, Mesh

    from jaxdist.comm import nccl

    mesh = Mesh(np.asarray(jax.devices("gpu")[:2]), ("pp",), axis_types=(AxisType.Explicit,))
    nccl.init(mesh)

    def make():
        return GPT(GPT_CFG, nnx.Rngs(0))

    batches = gpt_batches(STEPS)
    with jax.default_matmul_precision("highest"):
        ref_losses, ref_params, _, _ = train_single_device(make, next_token_loss, batches, adamw())
        out = {}
        for backend in ("nccl", "xla"):
            nccl.set_debug_delay(delay_us if backend == "nccl" else 0)
            try:
                strategy = Pipelined(mesh, microbatches=4, schedule="interleaved", virtual=2, backend=backend)
                out[backend] = pipeline_run(strategy, make, UNITS, batches, adamw())
            finally:
                nccl.set_debug_delay(0)
    for losses, params in out.values():
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        assert_params_close(params, ref_params)
