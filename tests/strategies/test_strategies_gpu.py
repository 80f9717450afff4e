"""DDP, ZeRO-1 and FSDP with the nccl backend on one GPU, against the xla backend (marked `gpu`).

One-rank communicators: the collectives are real NCCL calls on a side stream
(async start/wait), so ordering mistakes show up as wrong numbers, most of all
with the injected delay before every NCCL op.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh
from support.models import make_case
from support.reference import LOSS_RTOL, assert_params_close

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP, Units
from jaxdist.models.gpt import GPT, GPTConfig, embed_inputs, head_loss

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _exact_matmuls():
    # The default float32 matmul precision on GPU is TF32, whose rounding differs between the
    # two backends' programs; "highest" leaves only the reduction-order differences.
    with jax.default_matmul_precision("highest"):
        yield


def _mesh(axis):
    from jaxdist.comm import nccl

    mesh = Mesh(np.asarray(jax.devices("gpu")[:1]), (axis,), axis_types=(AxisType.Explicit,))
    nccl.init(mesh)
    return mesh


def _train(run, batches):
    state, losses = run.state, []
    for batch in batches:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
    return losses, jax.tree.map(np.asarray, run.params(state))


def _assert_same(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=LOSS_RTOL)
    assert_params_close(a[1], b[1])


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_ddp_nccl_matches_xla(zero1):
    mesh = _mesh("dp")
    make_model, loss_fn, batches = make_case("gpt", 4)
    out = {}
    for backend in ("nccl", "xla"):
        cfg = DDP(mesh, zero1=zero1, bucket_size=1000, backend=backend)
        out[backend] = _train(cfg.prepare(make_model(), optax.adam(1e-3), loss_fn, batches[0]), batches)
    assert len(set(out["nccl"][0])) == len(batches)  # the weights changed every step
    _assert_same(out["nccl"], out["xla"])


@pytest.mark.parametrize("remat", [None, False], ids=["recompute", "keep-activations"])
@pytest.mark.parametrize("delay_us", [0, 300], ids=["no-delay", "delay"])
def test_fsdp_nccl_matches_xla(delay_us, remat):
    """With the delay, a read of an in-flight buffer gives wrong numbers: this caught the nccl
    handles carried through FSDP's scan (XLA copied them early); the loop now unrolls. Both ways
    backward gets activations: recomputed, or kept with the weights' residuals rebuilt."""
    from jaxdist.comm import nccl

    mesh = _mesh("fsdp")
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
    _, _, batches = make_case("gpt", 4)
    units = Units(embed_inputs, head_loss)
    out = {}
    for backend in ("nccl", "xla"):
        nccl.set_debug_delay(delay_us if backend == "nccl" else 0)
        try:
            model = GPT(cfg, nnx.Rngs(0))
            run = FSDP(mesh, backend=backend, remat=remat).prepare(model, optax.adam(1e-3), units, batches[0])
            out[backend] = _train(run, batches)
        finally:
            nccl.set_debug_delay(0)
    _assert_same(out["nccl"], out["xla"])


def test_nccl_handle_carried_through_a_scan_is_refused():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist import comm

    mesh = _mesh("fsdp")

    def body(v):
        h, tok = comm.all_gather_start(v, "fsdp", comm.token(), backend="nccl")
        h, _ = jax.lax.scan(lambda c, _: (c, None), h, None, length=1)
        return comm.wait(h, tok)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False))
    with pytest.raises(ValueError, match="crossed a scan/while/jit boundary"):
        f(jax.device_put(jax.numpy.ones((4,), jax.numpy.float32), NamedSharding(mesh, P("fsdp"))))


@pytest.mark.parametrize("delay_us", [0, 300], ids=["no-delay", "delay"])
def test_unit_engine_nccl_uses_this_steps_weights(delay_us):
    """No read before publication on the GPU (docs/design.md): with a delay before every NCCL op, blocks still compute
    with the weights this step's data-parallel gather published (never last step's), and match the xla backend."""
    from jaxdist.comm import nccl
    from jaxdist.engine.run import Parallel
    from jaxdist.models.gpt import UNITS

    mesh = Mesh(np.asarray(jax.devices("gpu")[:1]).reshape(1, 1), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    nccl.init(mesh)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
    _, _, batches = make_case("gpt", 4)
    out = {}
    for backend in ("nccl", "xla"):
        nccl.set_debug_delay(delay_us if backend == "nccl" else 0)
        try:
            strategy = Parallel(mesh, record_weights=True, backend=backend)
            run = strategy.prepare(GPT(cfg, nnx.Rngs(0)), optax.adam(1e-3), UNITS, batches[0])
            state, losses = run.state, []
            for batch in batches:
                blocks = nnx.to_pure_dict(run.params(state))["blocks"]
                published = [
                    sum(np.sum(np.asarray(x, np.float64)) for x in jax.tree.leaves(blocks[i])) for i in range(4)
                ]
                state, m = run.step(state, batch)
                losses.append(float(m["loss"]))
                np.testing.assert_allclose(np.asarray(m["weights_used"]), published, rtol=1e-5)
            out[backend] = (losses, jax.tree.map(np.asarray, run.params(state)))
        finally:
            nccl.set_debug_delay(0)
    assert len(set(out["nccl"][0])) == len(batches)
    _assert_same(out["nccl"], out["xla"])


@pytest.mark.multigpu
def test_tensor_parallel_gpt_keeps_bf16_and_cudnn_attention():
    """Under TP the GPT's own forward runs: bf16 matmuls and cuDNN flash attention, as on one GPU."""
    import jax.numpy as jnp

    from jaxdist.engine.run import Parallel
    from jaxdist.models.gpt import UNITS, tp_plan_for

    mesh = Mesh(np.asarray(jax.devices("gpu")[:2]).reshape(1, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    cfg = GPTConfig(
        vocab_size=128, seq_len=128, d_model=128, n_heads=4, n_layers=2, dtype=jnp.bfloat16, attention="cudnn"
    )
    batch = {"tokens": np.zeros((4, 129), np.int32)}
    run = Parallel(mesh, plan=tp_plan_for(cfg)).prepare(GPT(cfg, nnx.Rngs(0)), optax.adam(1e-3), UNITS, batch)
    text = run.step.lower(run.state, batch).compile().as_text()
    assert "__cudnn$fmha" in text
    dots = [line for line in run.step.lower(run.state, batch).as_text().splitlines() if "dot_general" in line]
    assert dots and all("bf16" in line for line in dots)
    state, m = run.step(run.state, batch)
    assert np.isfinite(float(m["loss"]))


@pytest.mark.multigpu
@pytest.mark.parametrize("pack_units", [True, False], ids=["packed", "grouped"])
def test_fsdp_over_every_gpu_matches_the_xla_backend(pack_units):
    """FSDP over two or more GPUs with the nccl backend, each unit's gather and reduce-scatter packed into
    flat buffers or (`pack_units=False`) one NCCL group over its pieces in place, with a delay before every
    NCCL op: the xla backend's numbers."""
    from jaxdist.comm import nccl

    n = 2 if jax.device_count("gpu") < 4 else 4
    mesh = Mesh(np.asarray(jax.devices("gpu")[:n]), ("fsdp",), axis_types=(AxisType.Explicit,))
    nccl.init(mesh)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
    _, _, batches = make_case("gpt", 4)
    out = {}
    for backend in ("nccl", "xla"):
        nccl.set_debug_delay(300 if backend == "nccl" else 0)
        try:
            strategy = FSDP(mesh, pack_units=pack_units, backend=backend)
            run = strategy.prepare(GPT(cfg, nnx.Rngs(0)), optax.adam(1e-3), Units(embed_inputs, head_loss), batches[0])
            out[backend] = _train(run, batches)
        finally:
            nccl.set_debug_delay(0)
    assert len(set(out["nccl"][0])) == len(batches)
    _assert_same(out["nccl"], out["xla"])
