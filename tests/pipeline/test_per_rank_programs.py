"""Per-rank programs (`Pipelined(per_rank_programs=True)`): each process traces only its own pp rank's
column of the table, with no switch on the rank.

Here, in one process, the rank a process would hold is forced (the program is compiled, never run: every
device would run that rank's column) to read the compiled per-device program: it has no conditional
(the one-program step has a switch per tick, inside a loop over the ticks) and only loops whose trip
count is known when compiling (the column's repeating part), it traces its rank's ops alone, and under
1F1B its temporary memory does not grow with the micro-batch count. The column's cut into loops and
straight-line ticks is checked on its own; a process holding several pp ranks is refused by name. That
two processes' programs train as the one program does: tests/pipeline/test_per_rank_programs_two_processes.py.
"""

import re

import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import MLP_UNITS, ResMLP

from jaxdist.pipeline import run as pipeline_run
from jaxdist.pipeline.run import Pipelined
from jaxdist.pipeline.stage_ops import IDLE, StageOps
from jaxdist.pipeline.stage_step import rank_segments

D, F, ROWS = 128, 256, 64  # per micro-batch


def _compiled(monkeypatch, schedule: str, microbatches: int, rank: int | None, layers: int = 2):
    """(compiled text, temp bytes, the run) of one pp=2 step, traced as pp rank `rank`'s program (None: one program)."""
    if rank is not None:
        monkeypatch.setattr(pipeline_run, "process_pp_rank", lambda mesh, axis: rank)
    rng = np.random.default_rng(1)
    n = ROWS * microbatches
    batch = {"x": rng.normal(size=(n, 5)).astype(np.float32), "y": rng.normal(size=(n, 6)).astype(np.float32)}
    strategy = Pipelined(
        cpu_mesh((2,), ("pp",)), microbatches=microbatches, schedule=schedule, per_rank_programs=rank is not None
    )
    run = strategy.prepare(ResMLP(nnx.Rngs(0), d=D, f=F, layers=layers), optax.sgd(0.1), MLP_UNITS, batch)
    compiled = run.step.lower(run.state, batch).compile()
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes, run


def _count(text: str, op: str) -> int:
    return sum(1 for line in text.splitlines() if f" {op}(" in line)


# ZB-H1's column (its split backward) with the slow tests; the fast run pins 1F1B's
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_a_ranks_program_has_no_conditional_only_counted_loops_and_only_its_own_ops(monkeypatch, schedule):
    one, _, run = _compiled(monkeypatch, schedule, 4, None)
    assert _count(one, "conditional") > 0  # the one program: a switch per tick
    traced = []
    branch = StageOps.branch

    def recording(self, code):
        traced.append(code)
        return branch(self, code)

    monkeypatch.setattr(StageOps, "branch", recording)
    for rank in (0, 1):
        traced.clear()
        text, _, run = _compiled(monkeypatch, schedule, 8, rank)
        assert _count(text, "conditional") == 0
        loops = [line for line in text.splitlines() if " while(" in line]
        assert loops and all(re.search(r'known_trip_count":\{"n":"\d+"', line) for line in loops)
        assert set(traced) == {int(c) for c in run.plan.branch[:, rank] if c != IDLE}


def test_a_column_is_cut_into_its_repeating_part_and_the_ticks_around_it():
    f, b, i = "F", "B", "idle"
    one_f_one_b = [f, f, f, b, f, b, f, b, f, b, b, b, i]  # warm-up, steady state, cool-down
    assert rank_segments(one_f_one_b) == [(0, 1, 2), (2, 2, 4), (10, 1, 2), (12, 1, 1)]
    assert rank_segments([f, b, i]) == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]  # nothing repeats
    covered = [
        t for start, period, repeats in rank_segments(one_f_one_b) for t in range(start, start + period * repeats)
    ]
    assert covered == list(range(len(one_f_one_b)))


def test_a_ranks_program_holds_no_more_memory_for_more_microbatches_under_1f1b(monkeypatch):
    """Straight-line ticks with slots at indices known when tracing: 1F1B's pp slots bound the residuals, as in
    the one program (tests/pipeline/test_pipeline_activations.py)."""
    activation = ROWS * D * 4
    temps = {m: _compiled(monkeypatch, "1f1b", m, 0)[1] for m in (4, 8)}
    assert abs(temps[8] - temps[4]) < activation / 8, temps


def test_a_process_holding_several_pp_ranks_is_refused_by_name():
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(8, 5)).astype(np.float32), "y": rng.normal(size=(8, 6)).astype(np.float32)}
    strategy = Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2, per_rank_programs=True)
    with pytest.raises(ValueError, match=r"this process holds devices of pp ranks \[0, 1\]; each process must hold"):
        strategy.prepare(ResMLP(nnx.Rngs(0), d=16, f=32, layers=2), optax.sgd(0.1), MLP_UNITS, batch)
