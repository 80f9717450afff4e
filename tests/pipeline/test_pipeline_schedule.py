"""Pipeline schedule tables: hand-checked small cases, the bubble and in-flight bounds, and a
validator that rejects corrupted tables before anything is traced."""

import dataclasses

import pytest

from jaxdist.pipeline import schedule as ps

# Hand-checked: rank 0 warms up with pp - 1 = 1 forward, then alternates; rank 1 (the last
# stage) alternates from the start; a B waits for the later stage's B one tick earlier.
ONE_F_ONE_B_2_4 = [
    ["F0>", "."],
    ["F1>", "F0"],
    [".", "B0<"],
    ["B0", "F1"],
    ["F2>", "B1<"],
    ["B1", "F2"],
    ["F3>", "B2<"],
    ["B2", "F3"],
    [".", "B3<"],
    ["B3", "."],
]

GPIPE_2_2 = [["F0>", "."], ["F1>", "F0"], [".", "F1"], [".", "B0<"], ["B0", "B1<"], ["B1", "."]]

# pp=2, v=2: rank 0 holds stages 0 and 2 (chunks .0, .1), rank 1 stages 1 and 3. Micro-batch 0
# runs stage 0..3 forward at ticks 0..3 and back at ticks 4, 5, 7, 8 (tick 6: rank 1 first
# finishes micro-batch 1's last stage, 1F1B order).
INTERLEAVED_2_2_2 = [
    ["F0.0>", "."],
    ["F1.0>", "F0.0>"],
    ["F0.1>", "F1.0>"],
    ["F1.1>", "F0.1"],
    [".", "B0.1<"],
    ["B0.1<", "F1.1"],
    [".", "B1.1<"],
    ["B1.1<", "B0.0<"],
    ["B0.0", "B1.0<"],
    ["B1.0", "."],
]

# ZB-H1, pp=2: 1F1B's F and B order (B the input gradient alone); each W runs in a tick where its
# rank's next op must wait (tick 4: rank 0's F2 would make 3 micro-batches in flight, more than
# pp=2; tick 12: nothing else is left), so the cool-down has no idle tick left.
ZB_H1_2_4 = [
    ["F0>", "."],
    ["F1>", "F0"],
    [".", "B0<"],
    ["B0", "F1"],
    ["W0", "B1<"],
    ["F2>", "W0"],
    ["B1", "F2"],
    ["W1", "B2<"],
    ["F3>", "W1"],
    ["B2", "F3"],
    ["W2", "B3<"],
    ["B3", "W2"],
    ["W3", "W3"],
]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (lambda: ps.one_f_one_b(2, 4), ONE_F_ONE_B_2_4),
        (lambda: ps.gpipe(2, 2), GPIPE_2_2),
        (lambda: ps.interleaved(2, 2, 2), INTERLEAVED_2_2_2),
        (lambda: ps.zb_h1(2, 4), ZB_H1_2_4),
    ],
    ids=["1f1b-pp2-m4", "gpipe-pp2-m2", "interleaved-pp2-v2-m2", "zb-h1-pp2-m4"],
)
def test_generated_tables_equal_hand_checked_ones(schedule, expected):
    assert schedule().rows() == expected


def test_a_tick_sends_and_receives_what_its_ops_produce():
    tick = ps.one_f_one_b(2, 4).ticks[4]  # rank 0: F2 -> rank 1; rank 1: B1 -> rank 0
    assert tick.perm() == ((0, 1), (1, 0))
    assert tick.recvs[1] == ps.Message(ps.ACTIVATION, 2, 1, 0, 1)
    assert tick.recvs[0] == ps.Message(ps.GRADIENT, 1, 0, 1, 0)


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 16)])
def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    s = ps.one_f_one_b(pp, m)
    assert len(s.ticks) == 2 * (m + pp - 1)
    assert s.bubble == pytest.approx((pp - 1) / (m + pp - 1))
    assert ps.gpipe(pp, m).bubble == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 4), (4, 16)])
def test_1f1b_keeps_at_most_pp_microbatches_in_flight_gpipe_keeps_m(pp, m):
    assert [ps.one_f_one_b(pp, m).in_flight(r) for r in range(pp)] == [min(pp - r, m) for r in range(pp)]
    assert [ps.gpipe(pp, m).in_flight(r) for r in range(pp)] == [m] * pp


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 4)])
def test_interleaved_tables_are_valid_and_beat_1f1b_bubble(pp, v, m):
    s = ps.interleaved(pp, v, m)
    ps.validate(s)
    assert all(max(len(t.perm()), 0) <= pp for t in s.ticks)
    # the ideal (p - 1) / (v m + p - 1); a tick may be lost where two messages would meet one rank
    assert s.bubble <= (pp - 1) / (v * m + pp - 1) + 2 / len(s.ticks)
    assert s.bubble < ps.one_f_one_b(pp, m).bubble


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 5), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_takes_3m_plus_p_minus_1_ticks_with_1f1b_peak_memory(pp, m):
    """Qi et al.'s ZB-H1 at equal F, B and W times: a bubble of p - 1 op times, a third of 1F1B's
    3 (p - 1) (where B is the whole backward, B + W), once m >= p fills the warm-up; no rank keeps
    more activations than 1F1B's rank 0 (pp micro-batches)."""
    z, o = ps.zb_h1(pp, m), ps.one_f_one_b(pp, m)
    assert z.split and not o.split
    assert len(z.ticks) == z.span == 3 * m + pp - 1
    assert all(z.busy(r) == 3 * m for r in range(pp))
    assert o.span >= 3 * (m + pp - 1) > z.span
    assert z.timed_bubble == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert z.timed_bubble < o.timed_bubble
    assert max(z.in_flight(r) for r in range(pp)) == max(o.in_flight(r) for r in range(pp)) == min(pp, m)


def test_zb_h1_prints_its_ops_and_both_bubbles():
    text = str(ps.make("zbh1", 2, 4))
    assert "W3" in text.splitlines()[-2]
    assert text.splitlines()[-1] == (
        "zb-h1: pp=2 v=1 m=4, 13 ticks, bubble 0.077; timed (F=1, B=1, W=1): 13 units, bubble 0.077"
    )
    assert str(ps.one_f_one_b(2, 4)).splitlines()[-1].endswith("timed (F=1, B=2): 18 units, bubble 0.333")


def _corrupt(s: ps.Schedule, t: int, **changes) -> ps.Schedule:
    ticks = list(s.ticks)
    ticks[t] = dataclasses.replace(ticks[t], **changes)
    return dataclasses.replace(s, ticks=tuple(ticks))


def _swapped(s: ps.Schedule, a: int, b: int) -> ps.Schedule:
    ticks = list(s.ticks)
    ticks[a], ticks[b] = ticks[b], ticks[a]
    return dataclasses.replace(s, ticks=tuple(ticks))


def test_a_send_without_its_receive_is_rejected():
    s = ps.one_f_one_b(2, 4)
    bad = _corrupt(s, 1, recvs=(None, None))  # rank 0's activation of micro-batch 1 goes nowhere
    with pytest.raises(ps.ScheduleError, match="tick 1: rank 0 sends the activation of micro-batch 1 to rank 1"):
        ps.validate(bad)


def test_a_receive_without_its_send_is_rejected():
    s = ps.one_f_one_b(2, 4)
    ghost = ps.Message(ps.GRADIENT, 0, 0, 1, 0)
    with pytest.raises(ps.ScheduleError, match="tick 0: rank 0 receives the gradient of micro-batch 0 from rank 1"):
        ps.validate(_corrupt(s, 0, recvs=(ghost, s.ticks[0].recvs[1])))


def test_an_op_before_its_dependency_is_rejected():
    s = ps.one_f_one_b(2, 4)
    # swap ticks 2 and 3: rank 0's B0 would run before rank 1's B0 sent its gradient
    with pytest.raises(ps.ScheduleError, match=r"tick 2: rank 0 runs Op\(kind='B', microbatch=0, stage=0\) before"):
        ps.validate(_swapped(s, 2, 3))


def test_a_w_before_its_b_or_a_missing_w_is_rejected():
    s = ps.zb_h1(2, 4)
    # swap ticks 3 and 4: rank 0's W0 would run before its B0, rank 1's B1 before its F1
    with pytest.raises(ps.ScheduleError, match=r"tick 3: rank 0 runs Op\(kind='W', microbatch=0, stage=0\) before"):
        ps.validate(_swapped(s, 3, 4))
    # rank 0's W1 dropped (tick 7): the other Ws make the table split, so W1 must run
    no_w1 = _corrupt(s, 7, ops=(None, s.ticks[7].ops[1]))
    with pytest.raises(ps.ScheduleError, match=r"never runs \[Op\(kind='W', microbatch=1, stage=0\)\]"):
        ps.validate(no_w1)


def test_a_missing_op_is_rejected():
    s = ps.one_f_one_b(2, 4)
    with pytest.raises(ps.ScheduleError, match="never runs"):
        ps.validate(dataclasses.replace(s, ticks=s.ticks[:-1]))


def test_a_wrong_schedule_name_or_size_is_a_clear_error():
    with pytest.raises(ValueError, match="pick one of"):
        ps.make("zb", 2, 4)
    with pytest.raises(ValueError, match="multiple of pp=4"):
        ps.make("interleaved", 4, 6, v=2)
    with pytest.raises(ValueError, match="use 'interleaved'"):
        ps.make("1f1b", 2, 4, v=2)
