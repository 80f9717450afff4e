"""Every strategy run with the nccl backend waits every asynchronous NCCL op it starts.

The nccl backend lowers an async op to a pair of XLA custom calls, `jaxdist_nccl_start` and
`jaxdist_nccl_wait`. A start whose wait is missing leaves NCCL writing on a side stream into a
buffer XLA may already have given to something else: silent corruption on a GPU that no CPU run
can see (the bug fixed in jaxdist/ddp/bucket_schedule.py's `BucketSchedule.drain`). So each strategy's train step
is traced with `backend="nccl"` and lowered for CUDA, which needs no GPU (tracing reads only a
communicator's key, patched here), and its custom calls are read: as many waits as starts, at
least one start (every strategy here overlaps communication, so the check cannot pass vacuously),
and each wait's operands followed back (through the token chain's optimization barriers) to the
two results of one start in the same region (the body of one function, loop or branch), each
start waited exactly once and under its own `op_id`. Nothing is compiled or run. With
`backend="xla"` the same steps lower no nccl custom call at all.
"""

import collections
import dataclasses
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import support.transformer as transformer
from flax import nnx
from support.meshes import cpu_mesh
from support.models import (
    GPT_CFG,
    MLP,
    MLP_PLAN,
    MLP_UNITS,
    NET_UNITS,
    Net,
    ResMLP,
    WithUnusedLayers,
    gpt_batches,
    mlp_batches,
    mlp_loss,
    net_batches,
    net_loss,
)

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, tp_plan_for
from jaxdist.pipeline.run import Pipelined

# -- models and strategies (tiny: only traced and lowered) -------------------------------------


class ResMLPWithUnused(ResMLP):
    """support/models.py's ResMLP with parameters the loss never reads: a layer outside the blocks,
    and one in every block."""

    def __init__(self, rngs: nnx.Rngs, **kwargs):
        super().__init__(rngs, **kwargs)
        self.unused = nnx.Linear(16, 16, rngs=rngs)
        for layer in self.layers:
            layer.spare = nnx.Linear(16, 8, rngs=rngs)


def prepared(strategy: Callable, make_model: Callable, task, make_batch: Callable) -> Callable:
    """`build(backend) -> (run, batch)`: `strategy(backend).prepare(model, sgd, task, batch)`, where
    `task` is DDP's loss function or the unit engine's `Units`."""

    def build(backend: str):
        batch = make_batch()
        return strategy(backend).prepare(make_model(), optax.sgd(0.1), task, batch), batch

    return build


def square_batch(d: int) -> dict:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(16, d)).astype(np.float32), "y": rng.normal(size=(16, d)).astype(np.float32)}


def ddp(model: str = "mlp", **options) -> Callable:
    """DDP / ZeRO-1 over dp=8 with one bucket per layer. `model`: "mlp" (tests/support/reference.py),
    "unused" (a used layer, three the loss never reads), "odd" (support/models.py's ResMLP, with
    parameters no dimension of which 8 divides: zero1 all-reduces them whole)."""
    mesh = cpu_mesh((8,), ("dp",))
    if model == "odd":
        make, loss, batch, bucket = lambda: ResMLP(nnx.Rngs(0), layers=2), mlp_loss, lambda: mlp_batches(1)[0], 400
    elif model == "unused":
        make, loss, batch, bucket = lambda: WithUnusedLayers(nnx.Rngs(0)), mlp_loss, lambda: square_batch(32), 1056
    else:
        make, loss, batch, bucket = lambda: MLP(3, 16, nnx.Rngs(0)), mlp_loss, lambda: square_batch(16), 272
    return prepared(lambda b: DDP(mesh, bucket_size=bucket, backend=b, **options), make, loss, batch)


def mlp_units(strategy: Callable, make_model: Callable = lambda: ResMLP(nnx.Rngs(0), layers=2)) -> Callable:
    """A unit-engine strategy (`strategy(backend)`) on support/models.py's ResMLP."""
    return prepared(strategy, make_model, MLP_UNITS, lambda: mlp_batches(1)[0])


def gpt_units(strategy: Callable, tie: bool = False) -> Callable:
    """A unit-engine strategy on support/models.py's tiny GPT (sequence parallelism needs its plan)."""
    cfg = dataclasses.replace(GPT_CFG, tie_embeddings=tie)
    return prepared(
        lambda b: strategy(b, tp_plan_for(cfg)), lambda: GPT(cfg, nnx.Rngs(0)), UNITS, lambda: gpt_batches(1)[0]
    )


def transformer_units(strategy: Callable, mesh) -> Callable:
    """support/transformer.py's stacked local/global GQA transformer: side inputs, a padding mask,
    the token mean over ranks (sum_and_count) and aux outputs; its plan from its annotations."""
    cfg = transformer.Config()
    plan = transformer.annotated_plan(transformer.make_model(cfg)) if "tp" in mesh.axis_names else None
    return prepared(
        lambda b: strategy(b, plan),
        lambda: transformer.make_model(cfg, mesh),
        transformer.UNITS,
        lambda: transformer.batches(1)[0],
    )


def dropout_batchnorm(strategy: Callable, task) -> Callable:
    """support/models.py's Net with dropout (input and every block) and BatchNorm."""
    make = lambda: Net([0.5, 2.0], nnx.Rngs(0, dropout=3), input_dropout=0.2, dropout=0.3, batchnorm=True)  # noqa: E731
    return prepared(strategy, make, task, lambda: net_batches(1, batch_size=16)[0])


UNUSED = lambda: ResMLPWithUnused(nnx.Rngs(0), layers=2)  # noqa: E731
DP8, FSDP8 = cpu_mesh((8,), ("dp",)), cpu_mesh((8,), ("fsdp",))
DP4XTP2, FSDP2XTP4 = cpu_mesh((4, 2), ("dp", "tp")), cpu_mesh((2, 4), ("fsdp", "tp"))
DP2XFSDP2XTP2 = cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
PP2XDP4 = cpu_mesh((2, 4), ("pp", "dp"))

# name -> build(backend) -> (prepared run, example batch); every strategy here overlaps communication
CASES = {
    "ddp": ddp(),
    "ddp-reduce-after-backward": ddp(overlap_grad_reduce=False),
    "ddp-accumulate2": ddp(accumulation_steps=2),
    "ddp-unused-params": ddp("unused"),
    "ddp-dropout-batchnorm": dropout_batchnorm(lambda b: DDP(DP8, bucket_size=300, backend=b), net_loss),
    "zero1-overlap-gather": ddp(zero1=True),
    "zero1-gather-first": ddp(zero1=True, overlap_param_gather=False),
    "zero1-accumulate2": ddp(zero1=True, accumulation_steps=2),
    "zero1-unpacked": ddp(zero1=True, pack_buckets=False),
    "ddp-unpacked-accumulate2": ddp(accumulation_steps=2, pack_buckets=False),
    "zero1-reduce-after-backward": ddp(zero1=True, overlap_grad_reduce=False),
    "zero1-unused-params-overlap-gather": ddp("unused", zero1=True),
    "zero1-unused-params-gather-first": ddp("unused", zero1=True, overlap_param_gather=False),
    "zero1-unused-params-accumulate2": ddp("unused", zero1=True, accumulation_steps=2),
    "zero1-unsplittable-params": ddp("odd", zero1=True),
    "fsdp": mlp_units(lambda b: FSDP(FSDP8, backend=b)),
    "fsdp-unused-params": mlp_units(lambda b: FSDP(FSDP8, backend=b), UNUSED),
    "fsdp-keep-gathered": mlp_units(lambda b: FSDP(FSDP8, reshard_after_forward=False, backend=b)),
    "fsdp-buffers3-prefetch2": mlp_units(
        lambda b: FSDP(FSDP8, buffers=3, prefetch=2, backend=b), lambda: ResMLP(nnx.Rngs(0), layers=3)
    ),
    "fsdp-update-in-backward": mlp_units(lambda b: FSDP(FSDP8, update_in_backward=True, backend=b)),
    "fsdp-bf16-compute": mlp_units(lambda b: FSDP(FSDP8, compute_dtype=jnp.bfloat16, backend=b)),
    "fsdp-gpt-tied-embeddings": gpt_units(lambda b, _: FSDP(FSDP8, backend=b), tie=True),
    "fsdp-keep-activations-dropout-batchnorm": dropout_batchnorm(
        lambda b: FSDP(FSDP8, remat=False, backend=b), NET_UNITS
    ),
    "fsdp-unpacked-update-in-backward": mlp_units(
        lambda b: FSDP(FSDP8, pack_units=False, update_in_backward=True, backend=b)
    ),
    "hsdp-dp2xfsdp4-unpacked": mlp_units(
        lambda b: FSDP(cpu_mesh((2, 4), ("dp", "fsdp")), dp_axis="dp", pack_units=False, backend=b)
    ),
    "hsdp-dp2xfsdp4": mlp_units(lambda b: FSDP(cpu_mesh((2, 4), ("dp", "fsdp")), dp_axis="dp", backend=b)),
    "engine-zero3-remat": mlp_units(lambda b: Parallel(FSDP8, remat=True, backend=b)),
    "engine-zero3-keep-activations": mlp_units(lambda b: Parallel(FSDP8, remat=False, backend=b)),
    "engine-zero3-keep-activations-unused-params": mlp_units(lambda b: Parallel(FSDP8, remat=False, backend=b), UNUSED),
    "engine-zero1": mlp_units(lambda b: Parallel(DP8, backend=b)),
    "engine-dp4xtp2": mlp_units(lambda b: Parallel(DP4XTP2, plan=MLP_PLAN, backend=b)),
    "engine-dp4xtp2-replicated": mlp_units(lambda b: Parallel(DP4XTP2, plan=MLP_PLAN, zero1=False, backend=b)),
    "engine-dp4xtp2-unpacked-unused-params": mlp_units(
        lambda b: Parallel(DP4XTP2, plan=MLP_PLAN, pack_units=False, backend=b), UNUSED
    ),
    "engine-dp4xtp2-unused-params": mlp_units(lambda b: Parallel(DP4XTP2, plan=MLP_PLAN, backend=b), UNUSED),
    "engine-fsdp2xtp4-seqpar-gpt": gpt_units(
        lambda b, plan: Parallel(FSDP2XTP4, plan=plan, sequence_parallel=True, backend=b)
    ),
    "engine-dp2xfsdp2xtp2-seqpar-keep-activations-gpt": gpt_units(
        lambda b, plan: Parallel(DP2XFSDP2XTP2, plan=plan, sequence_parallel=True, remat=False, backend=b)
    ),
    "engine-dp2xfsdp2xtp2-seqpar-stacked-transformer": transformer_units(
        lambda b, plan: Parallel(DP2XFSDP2XTP2, plan=plan, sequence_parallel=True, backend=b), DP2XFSDP2XTP2
    ),
    "engine-fsdp8-update-in-backward-stacked-transformer": transformer_units(
        lambda b, _: Parallel(FSDP8, update_in_backward=True, backend=b), FSDP8
    ),
    "pipeline-pp2xdp4-1f1b": mlp_units(lambda b: Pipelined(PP2XDP4, microbatches=4, backend=b)),
    "pipeline-pp2xdp4-unpacked": mlp_units(lambda b: Pipelined(PP2XDP4, microbatches=4, pack_units=False, backend=b)),
    "pipeline-pp2xdp4-interleaved-v2": mlp_units(
        lambda b: Pipelined(PP2XDP4, microbatches=4, schedule="interleaved", virtual=2, backend=b),
        lambda: ResMLP(nnx.Rngs(0), layers=4),
    ),
    "pipeline-pp2xfsdp4-gpipe-unused-params": mlp_units(
        lambda b: Pipelined(cpu_mesh((2, 4), ("pp", "fsdp")), microbatches=4, schedule="gpipe", backend=b), UNUSED
    ),
    "pipeline-pp2xdp2xtp2-1f1b": mlp_units(
        lambda b: Pipelined(cpu_mesh((2, 2, 2), ("pp", "dp", "tp")), plan=MLP_PLAN, microbatches=2, backend=b)
    ),
}


# -- lowering and reading the custom calls ---------------------------------------------------


@pytest.fixture
def nccl_tracing(monkeypatch):
    """The nccl backend traceable on CPU: it needs no GPU, and tracing reads only a communicator's key."""
    from jaxdist.comm import nccl

    monkeypatch.setattr(nccl, "_comm_key", lambda axis_name: 7)
    monkeypatch.setattr(nccl, "nccl_backend", nccl.NcclBackend)


def lowered_for_cuda(build: Callable, backend: str) -> str:
    """The StableHLO text of a strategy's train step, traced with `backend` and lowered for CUDA."""
    run, batch = build(backend)
    return run.step.jitted.trace(run.state, run.step._place(batch)).lower(lowering_platforms=("cuda",)).as_text()


_DEFINITION = re.compile(r"^(%[\w.]+)(?::(\d+))? = (.*)$")
_NCCL_CALL = re.compile(r"custom_call @(jaxdist_nccl_\w+)\(([^)]*)\)")
_BARRIER = re.compile(r"stablehlo\.optimization_barrier (.*?) : ")
_OP_ID = re.compile(r"\bop_id = (\d+) : i64")
_ASYNC = ("jaxdist_nccl_start", "jaxdist_nccl_wait", "jaxdist_nccl_start_group", "jaxdist_nccl_wait_group")


@dataclasses.dataclass
class AsyncCalls:
    """The async nccl calls of a lowered module: each start (of one op or a group) as `(region, value)`
    with its op_id, and each wait with the start its operands come from (None: not all of one start's
    results, in order, of its own kind)."""

    starts: dict[tuple, int]
    waits: list[tuple[int, tuple | None]]  # (op_id, the start it finishes)


def async_calls(hlo: str) -> AsyncCalls:
    """Read the starts and waits of `hlo`, and follow each wait's operands back to their start.

    Between the two, jaxdist's ops pass the buffers only through optimization barriers (the token
    sequencing), which forward operand i as result i: anything else, or a value from another region
    (the body of a function, loop or branch), leaves the wait without a start. A region is named by
    the line that opens it: a line ending with "{" opens one, a line starting with "}" closes one."""
    regions, starts, waits, grouped = [], {}, [], {}
    forwards: dict[tuple, tuple] = {}  # a barrier's result -> its operand, both as (region, "%v#i")

    def resolve(value: tuple) -> tuple:
        while value in forwards:
            value = forwards[value]
        return value

    def results(name: str, operands: list[str]) -> list[str]:
        return [f"{name}#{i}" for i in range(len(operands))] if len(operands) > 1 else [name]

    for number, line in enumerate(hlo.splitlines()):
        text = line.strip()
        if text.startswith("}"):
            regions.pop()
        region = regions[-1] if regions else None
        definition = _DEFINITION.match(text)
        call = _NCCL_CALL.search(text)
        barrier = _BARRIER.search(text)
        if definition and barrier:
            operands = [v.strip() for v in barrier.group(1).split(",")]
            for result, operand in zip(results(definition.group(1), operands), operands, strict=True):
                forwards[region, result] = (region, operand)
        if call and call.group(1) in _ASYNC:
            op_id = int(_OP_ID.search(text).group(1))
            group = call.group(1).endswith("_group")
            if "_start" in call.group(1):
                starts[region, definition.group(1)] = op_id
                grouped[region, definition.group(1)] = group, int(definition.group(2) or 1)
            else:
                # a wait takes all its start's results, in order: 2 of one op, 2n of a group of n
                operands = [resolve((region, v.strip())) for v in call.group(2).split(",")]
                origin = {(r, v.split("#")[0]) for r, v in operands}
                in_order = [v.split("#")[-1] for _, v in operands] == [str(i) for i in range(len(operands))]
                paired = len(origin) == 1 and in_order and (group or len(operands) == 2)
                start = origin.pop() if paired and origin <= starts.keys() else None
                complete = start is not None and grouped[start] == (group, len(operands))  # every result, same kind
                waits.append((op_id, start if complete else None))
        if text.endswith("{"):
            regions.append(number)
    assert not regions, "the module's regions did not close: the text format changed, fix async_calls"
    return AsyncCalls(starts, waits)


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_every_started_nccl_op_is_waited_once(nccl_tracing, case):
    hlo = lowered_for_cuda(CASES[case], "nccl")
    n_starts, n_waits = hlo.count("custom_call @jaxdist_nccl_start"), hlo.count("custom_call @jaxdist_nccl_wait")
    assert n_starts >= 1  # the strategy overlaps communication: the check is not vacuous
    assert n_starts == n_waits
    calls = async_calls(hlo)
    assert len(calls.starts) == n_starts and len(calls.waits) == n_waits  # every call was read
    unpaired = [op_id for op_id, start in calls.waits if start is None]
    assert not unpaired, f"waits (by op_id) not on the two results of a start in their own region: {unpaired}"
    finished = collections.Counter(start for _, start in calls.waits)
    assert set(finished) == set(calls.starts) and set(finished.values()) == {1}, "a start waited twice or never"
    assert all(calls.starts[start] == op_id for op_id, start in calls.waits)  # the wait names its start's op


@pytest.mark.parametrize("case", ["zero1-overlap-gather", "fsdp", "engine-dp4xtp2", "pipeline-pp2xdp4-1f1b"])
def test_the_xla_backend_lowers_no_nccl_call(case):  # one case per strategy family: the backend is the switch
    assert "jaxdist_nccl" not in lowered_for_cuda(CASES[case], "xla")


@pytest.mark.parametrize("case", ["zero1-unpacked", "ddp-unpacked-accumulate2"])
def test_unpacked_buckets_are_one_nccl_group_each(nccl_tracing, case):
    """pack_buckets=False: each bucket's gradients (and under zero1 its gather) are one group start over
    the bucket's parameters in place, a kernel and a bias each here, and no single-op start."""
    run, _ = CASES[case]("nccl")
    hlo = lowered_for_cuda(CASES[case], "nccl")
    groups = re.findall(r"custom_call @jaxdist_nccl_start_group\(([^)]*)\)", hlo)
    buckets = len(run.layout)
    assert len(groups) == buckets * (2 if "zero1" in case else 1), groups  # reductions, and gathers
    assert all(len(operands.split(",")) == 2 for operands in groups)
    assert "custom_call @jaxdist_nccl_start(" not in hlo


def test_the_reader_pairs_each_wait_with_its_start_and_reports_what_is_not():
    """The reader of the lowered text itself: a start and its wait pair up through barriers; a start
    never waited, a wait on another value and a wait inside a loop body are reported."""

    def module(*lines):
        return "\n".join(["func.func public @main(%0: tensor<4xf32>) {", *lines, "}"])

    start = "%1:2 = stablehlo.custom_call @jaxdist_nccl_start(%0) {mhlo.backend_config = {op_id = 3 : i64}}"
    barrier = "%2:3 = stablehlo.optimization_barrier %1#0, %1#1, %t : tensor<4xf32>, tensor<8xf32>, tensor<ui8>"
    wait = "%4 = stablehlo.custom_call @jaxdist_nccl_wait(%2#0, %2#1) {mhlo.backend_config = {op_id = 3 : i64}}"
    paired = async_calls(module(start, barrier, wait))
    assert paired.starts == {(0, "%1"): 3} and paired.waits == [(3, (0, "%1"))]
    assert async_calls(module(start, barrier)).waits == []  # a start never waited
    swapped = wait.replace("(%2#0, %2#1)", "(%2#1, %2#0)")
    assert async_calls(module(start, barrier, swapped)).waits == [(3, None)]
    loop = ["%5 = stablehlo.while(%2#0)", "cond {", "} do {", wait, "}"]  # as jax prints a loop
    assert async_calls(module(start, barrier, *loop)).waits == [(3, None)]
    group = "%1:4 = stablehlo.custom_call @jaxdist_nccl_start_group(%0, %0) {mhlo.backend_config = {op_id = 5 : i64}}"
    group_barrier = "%2:5 = stablehlo.optimization_barrier %1#0, %1#1, %1#2, %1#3, %t : tensor<4xf32>"
    group_wait = "%4:2 = stablehlo.custom_call @jaxdist_nccl_wait_group(%2#0, %2#1, %2#2, %2#3) {op_id = 5 : i64}"
    assert async_calls(module(group, group_barrier, group_wait)).waits == [(5, (0, "%1"))]
    part = group_wait.replace("(%2#0, %2#1, %2#2, %2#3)", "(%2#0, %2#1)")  # half of the group's buffers
    assert async_calls(module(group, group_barrier, part)).waits == [(5, None)]
    single = group_wait.replace("_wait_group", "_wait").replace(", %2#2, %2#3", "")  # a single wait on a group
    assert async_calls(module(group, group_barrier, single)).waits == [(5, None)]
