"""Pipeline schedules as data: which stage runs which micro-batch at each tick, and what moves.

A pipeline splits the model into `pp * v` stages; rank r holds the `v` stages
`r, r + pp, r + 2 pp, ...` (its chunks; `v > 1` is the interleaved schedule).
A tick is one time slot: every rank runs at most one op, the forward `F` or the
backward `B` of one micro-batch on one of its stages, then the tick's messages
move: the activation an `F` produced goes to the next stage's rank, the input
gradient a `B` produced to the previous stage's rank. A zero-bubble table splits
the backward: `B` is then the input gradient only (what the previous stage
waits for) and `W` the weight gradient, which sends nothing and may run later,
in a tick that would be idle. A message is received in
the tick it is sent (one `comm.sendrecv` per tick), and used in a later tick.
Each rank sends and receives at most one message per tick (what one sendrecv
carries); generators delay an op rather than break that.

`validate` proves a table executable before anything is traced: every send has
its receive on the neighbour in the same tick (and no receive lacks its send),
every op runs once and after what it depends on (F of stage s after F of
stage s - 1; B after its own F and after B of stage s + 1; W after its own B),
every message is received before the op that needs it, and a table has a W for
every B or none. With those, the ticks in order are an
execution, so the table cannot deadlock.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
ACTIVATION, GRADIENT = "activation", "gradient"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
ALIASES = {"zbh1": "zb-h1"}


@dataclasses.dataclass(frozen=True)
class Op:
    """The forward (`F`), backward (`B`; the input gradient alone where the table has `W` ops) or
    weight gradient (`W`) of `microbatch` on global stage `stage`."""

    kind: str
    microbatch: int
    stage: int

    def label(self, pp: int, v: int) -> str:
        chunk = f".{self.stage // pp}" if v > 1 else ""
        return f"{self.kind}{self.microbatch}{chunk}"


@dataclasses.dataclass(frozen=True)
class Message:
    """An activation (stage -> stage + 1) or gradient (stage -> stage - 1) of `microbatch`,
    from rank `src` to rank `dst`; `stage` is the stage that consumes it."""

    kind: str
    microbatch: int
    stage: int
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class Tick:
    """One tick: per rank the op it runs (None: idle), the message it sends and the one it receives."""

    ops: tuple[Op | None, ...]
    sends: tuple[Message | None, ...]
    recvs: tuple[Message | None, ...]

    def perm(self) -> tuple[tuple[int, int], ...]:
        """The (src, dst) rank pairs of this tick's sendrecv (empty: no communication)."""
        return tuple((m.src, m.dst) for m in self.sends if m is not None)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule table for `pp` ranks, `v` stages per rank and `m` micro-batches."""

    name: str
    pp: int
    v: int
    m: int
    ticks: tuple[Tick, ...]

    @property
    def stages(self) -> int:
        return self.pp * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def busy(self, rank: int) -> int:
        return sum(t.ops[rank] is not None for t in self.ticks)

    @functools.cached_property
    def split(self) -> bool:
        """Whether the backward is split into `B` (input gradient) and `W` (weight gradient) ops."""
        return any(op is not None and op.kind == WEIGHT for t in self.ticks for op in t.ops)

    @property
    def bubble(self) -> float:
        """Idle fraction of rank-ticks (every op counted as one tick of work)."""
        total = len(self.ticks) * self.pp
        return 1 - sum(self.busy(r) for r in range(self.pp)) / total

    def cost(self, op: Op | None) -> int:
        """An op's work in units of a forward: F and the split B and W one each, an unsplit B two."""
        if op is None:
            return 0
        return 2 if op.kind == BACKWARD and not self.split else 1

    @property
    def span(self) -> int:
        """The step's length in forward units when every tick lasts as long as its longest op (the
        ticks are synchronous: a tick's sendrecv waits for every rank's op)."""
        return sum(max(self.cost(op) for op in t.ops) for t in self.ticks)

    @property
    def timed_bubble(self) -> float:
        """Idle fraction of the ranks' time over `span` (ops weighted by `cost`): the bubble to compare
        across split and unsplit tables."""
        work = sum(self.cost(op) for t in self.ticks for op in t.ops)
        return 1 - work / (self.span * self.pp)

    def in_flight(self, rank: int) -> int:
        """The most micro-batch stages whose forward ran on `rank` and whose backward (its `W` in a
        split table) has not yet: the activations the rank keeps alive for backward."""
        release = WEIGHT if self.split else BACKWARD
        live = peak = 0
        for t in self.ticks:
            op = t.ops[rank]
            if op is not None and op.kind in (FORWARD, release):
                live += 1 if op.kind == FORWARD else -1
                peak = max(peak, live)
        return peak

    def __str__(self) -> str:
        """A tick per row, a rank per column: `F3` forward of micro-batch 3 (`F3.1`: on the rank's
        chunk 1), `B3` backward, `W3` weight gradient, `.` idle; `>` / `<` after it: it sends to the
        next / previous rank. The last line: the tick count and bubble, then the timed ones."""
        head = ["tick"] + [f"rank{r}" for r in range(self.pp)]
        rows = [head]
        for i, t in enumerate(self.ticks):
            row = [str(i)]
            for r in range(self.pp):
                op, send = t.ops[r], t.sends[r]
                cell = "." if op is None else op.label(self.pp, self.v)
                if send is not None:
                    cell += ">" if send.kind == ACTIVATION else "<"
                row.append(cell)
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.append(
            f"{self.name}: pp={self.pp} v={self.v} m={self.m}, {len(self.ticks)} ticks, bubble {self.bubble:.3f}; "
            f"timed (F=1, B={1 if self.split else 2}{', W=1' if self.split else ''}): {self.span} units, "
            f"bubble {self.timed_bubble:.3f}"
        )
        return "\n".join(lines)

    def rows(self) -> list[list[str]]:
        """The op labels (with send marks) per tick and rank, as `str` prints them."""
        return [line.split()[1:] for line in str(self).splitlines()[1:-1]]


class ScheduleError(ValueError):
    """A schedule table that cannot run as written."""


def _message(op: Op, pp: int, stages: int) -> Message | None:
    """What `op` sends: F's activation to the next stage, B's gradient to the previous one."""
    if op.kind == FORWARD and op.stage < stages - 1:
        return Message(ACTIVATION, op.microbatch, op.stage + 1, op.stage % pp, (op.stage + 1) % pp)
    if op.kind == BACKWARD and op.stage > 0:
        return Message(GRADIENT, op.microbatch, op.stage - 1, op.stage % pp, (op.stage - 1) % pp)
    return None


def _needs(op: Op, stages: int) -> list[Op]:
    """The ops that must run at an earlier tick than `op`."""
    if op.kind == FORWARD:
        return [Op(FORWARD, op.microbatch, op.stage - 1)] if op.stage > 0 else []
    if op.kind == WEIGHT:
        return [Op(BACKWARD, op.microbatch, op.stage)]
    deps = [Op(FORWARD, op.microbatch, op.stage)]
    if op.stage < stages - 1:
        deps.append(Op(BACKWARD, op.microbatch, op.stage + 1))
    return deps


def _place(name: str, pp: int, v: int, m: int, orders: list[list[Op]], bound: list[int] | None = None) -> Schedule:
    """Run each rank's op order as early as its dependencies allow (list scheduling), an op waiting
    a tick where its message's receiver already receives one: the table of that execution.

    With `bound` (a split table) each B queues its W, and a rank runs its oldest queued W in a tick
    where its next op cannot run, or where that op is an F and `bound[rank]` micro-batches already
    hold activations (forward run, W not yet): so W fills the bubbles and the activations a rank
    keeps never exceed its bound; queued Ws left at the end run in order."""
    stages = pp * v
    when: dict[Op, int] = {}
    pos = [0] * pp
    queued: list[list[Op]] = [[] for _ in range(pp)]
    live = [0] * pp
    ticks = []
    while any(pos[r] < len(orders[r]) or queued[r] for r in range(pp)):
        t = len(ticks)
        ops: list[Op | None] = [None] * pp
        sends: list[Message | None] = [None] * pp
        recvs: list[Message | None] = [None] * pp
        for r in range(pp):
            op = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            ready = op is not None and all(when.get(d, t) < t for d in _needs(op, stages))
            msg = _message(op, pp, stages) if ready else None
            ready = ready and not (msg is not None and recvs[msg.dst] is not None)
            if bound is not None and ready and op.kind == FORWARD and live[r] >= bound[r]:
                ready = False
            if not ready:
                if queued[r]:  # queued at the end of its B's tick: runs after it
                    ops[r] = queued[r].pop(0)
                continue
            ops[r], sends[r] = op, msg
            if msg is not None:
                recvs[msg.dst] = msg
        if not any(ops):
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise ScheduleError(f"{name}: the op orders deadlock at tick {t}: waiting ops {stuck}")
        for r, op in enumerate(ops):
            if op is None:
                continue
            when[op] = t
            if op.kind == WEIGHT:
                live[r] -= 1
                continue
            pos[r] += 1
            live[r] += op.kind == FORWARD
            if bound is not None and op.kind == BACKWARD:
                queued[r].append(Op(WEIGHT, op.microbatch, op.stage))
        ticks.append(Tick(tuple(ops), tuple(sends), tuple(recvs)))
    schedule = Schedule(name, pp, v, m, tuple(ticks))
    validate(schedule)
    return schedule


def _check_sizes(name: str, pp: int, v: int, m: int) -> None:
    for what, x in (("pp", pp), ("v", v), ("microbatches", m)):
        if not isinstance(x, int) or x < 1:
            raise ValueError(f"{name}: {what} must be an int >= 1, got {x!r}")


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe (Huang et al., 2019): every micro-batch forward, then every backward."""
    _check_sizes("gpipe", pp, 1, m)
    orders = [[Op(k, i, r) for k in (FORWARD, BACKWARD) for i in range(m)] for r in range(pp)]
    return _place("gpipe", pp, 1, m, orders)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): rank r runs pp - r - 1 warm-up forwards, then
    alternates one forward and one backward, then drains; at most pp micro-batches in flight."""
    _check_sizes("1f1b", pp, 1, m)
    return _place("1f1b", pp, 1, m, _one_f_one_b_orders(pp, m))


def _one_f_one_b_orders(pp: int, m: int) -> list[list[Op]]:
    orders = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        order = [Op(FORWARD, i, r) for i in range(warm)]
        for i in range(warm, m):
            order += [Op(FORWARD, i, r), Op(BACKWARD, i - warm, r)]
        order += [Op(BACKWARD, i, r) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def zb_h1(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order with the backward
    split into B (the input gradient, which the previous stage waits for) and W (the weight
    gradient): a W runs where its rank would wait, so the cool-down's bubble fills with W ops. Every
    rank keeps at most pp micro-batches' activations (forward run, W not yet), the most any rank
    keeps under 1F1B (rank 0): the same peak memory. At equal F, B and W times its length is
    3 m + pp - 1 ticks: a bubble of pp - 1 op times, a third of 1F1B's."""
    _check_sizes("zb-h1", pp, 1, m)
    return _place("zb-h1", pp, 1, m, _one_f_one_b_orders(pp, m), bound=[pp] * pp)


def interleaved(pp: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al., 2021): rank r holds stages r, r + pp, ...;
    micro-batches go through its chunks in groups of pp; warm-up 2 (pp - r - 1) + (v - 1) pp forwards.
    Needs m divisible by pp."""
    _check_sizes("interleaved", pp, v, m)
    if m % pp:
        raise ValueError(f"interleaved: microbatches={m} must be a multiple of pp={pp} (groups of pp micro-batches)")
    n = m * v

    def forward(k: int, r: int) -> Op:
        chunk, i = (k // pp) % v, (k // (pp * v)) * pp + k % pp
        return Op(FORWARD, i, chunk * pp + r)

    def backward(k: int, r: int) -> Op:
        chunk, i = v - 1 - (k // pp) % v, (k // (pp * v)) * pp + k % pp
        return Op(BACKWARD, i, chunk * pp + r)

    orders = []
    for r in range(pp):
        warm = min(2 * (pp - r - 1) + (v - 1) * pp, n)
        order = [forward(k, r) for k in range(warm)]
        for k in range(warm, n):
            order += [forward(k, r), backward(k - warm, r)]
        order += [backward(k, r) for k in range(n - warm, n)]
        orders.append(order)
    return _place("interleaved", pp, v, m, orders)


def make(name: str, pp: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` (one of `SCHEDULES`, or an alias: "zbh1")."""
    name = ALIASES.get(name, name)
    makers: dict[str, Callable[[], Schedule]] = {
        "gpipe": lambda: gpipe(pp, m),
        "1f1b": lambda: one_f_one_b(pp, m),
        "interleaved": lambda: interleaved(pp, v, m),
        "zb-h1": lambda: zb_h1(pp, m),
    }
    if name not in makers:
        raise ValueError(f"pipeline schedule {name!r} is unknown; pick one of {SCHEDULES}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"pipeline schedule {name!r} runs one stage per rank (v=1, got v={v}); use 'interleaved'")
    return makers[name]()


def validate(s: Schedule) -> None:
    """Raise `ScheduleError` (naming the tick, rank and op) unless `s` can run as written."""
    stages = s.stages
    when: dict[Op, int] = {}
    received: dict[tuple[str, int, int], int] = {}
    for t, tick in enumerate(s.ticks):
        if not (len(tick.ops) == len(tick.sends) == len(tick.recvs) == s.pp):
            raise ScheduleError(f"tick {t}: needs one op, send and receive entry per rank ({s.pp} ranks)")
        for r, (send, recv) in enumerate(zip(tick.sends, tick.recvs, strict=True)):
            if send is not None:
                if send.src != r or not 0 <= send.dst < s.pp or tick.recvs[send.dst] != send:
                    raise ScheduleError(
                        f"tick {t}: rank {r} sends the {send.kind} of micro-batch {send.microbatch} to rank "
                        f"{send.dst}, which does not receive it at tick {t}; every send needs its receive on "
                        "the neighbour in the same tick"
                    )
            if recv is not None and (recv.dst != r or not 0 <= recv.src < s.pp or tick.sends[recv.src] != recv):
                raise ScheduleError(
                    f"tick {t}: rank {r} receives the {recv.kind} of micro-batch {recv.microbatch} from rank "
                    f"{recv.src}, which does not send it at tick {t}; every receive needs its send"
                )
        for r, op in enumerate(tick.ops):
            expected = None if op is None else _message(op, s.pp, stages)
            if tick.sends[r] != expected:
                raise ScheduleError(
                    f"tick {t}: rank {r} runs {op} and sends {tick.sends[r]}; an op sends exactly its output "
                    f"({expected}) in its own tick"
                )
            if op is None:
                continue
            if op.kind not in (FORWARD, BACKWARD, WEIGHT):
                raise ScheduleError(f"tick {t}: rank {r} runs {op}, of no kind F, B or W")
            if not (0 <= op.stage < stages and op.stage % s.pp == r and 0 <= op.microbatch < s.m):
                raise ScheduleError(f"tick {t}: rank {r} cannot run {op} (stage or micro-batch out of range)")
            if op in when:
                raise ScheduleError(f"tick {t}: {op} already ran at tick {when[op]}")
            for dep in _needs(op, stages):
                if when.get(dep, t) >= t:
                    raise ScheduleError(f"tick {t}: rank {r} runs {op} before {dep} ran; it depends on it")
            kind = ACTIVATION if op.kind == FORWARD else GRADIENT
            has_input = op.stage > 0 if op.kind == FORWARD else op.kind == BACKWARD and op.stage < stages - 1
            if has_input and received.get((kind, op.microbatch, op.stage), t) >= t:
                raise ScheduleError(f"tick {t}: rank {r} runs {op} before receiving its {kind}")
        for op in tick.ops:
            if op is not None:
                when[op] = t
        for msg in tick.recvs:
            if msg is not None:
                received[(msg.kind, msg.microbatch, msg.stage)] = t
    kinds = (FORWARD, BACKWARD, WEIGHT) if s.split else (FORWARD, BACKWARD)
    missing = [Op(k, i, st) for k in kinds for i in range(s.m) for st in range(stages)]
    missing = [op for op in missing if op not in when]
    if missing:
        raise ScheduleError(f"the table never runs {missing[:4]}{' ...' if len(missing) > 4 else ''}")
