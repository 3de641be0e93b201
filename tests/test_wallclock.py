"""The wall-clock model against hand-computed values."""

import pytest

from mtdao.experiments.compare.wallclock import (
    LINK_PRESETS,
    Link,
    allreduce_seconds,
    run_seconds,
    step_end_times,
    time_to_step,
)

GIGABIT = Link("test-1gbit", 1.0, 1e-3)


def every(period: int, steps: int, num_bytes: float) -> list[tuple[int, float]]:
    """A state of ``num_bytes`` averaged after every ``period``-th step."""
    return [(step, num_bytes) for step in range(period, steps + 1, period)]


def test_ring_allreduce_by_hand():
    # 4 workers, 100 MB at 1 Gbit/s: 2*3/4 * 8e8 bits / 1e9 = 1.5 * 0.8 = 1.2 s, plus latency.
    assert allreduce_seconds(100e6, 4, GIGABIT) == pytest.approx(1.2 + 6 * 1e-3)
    # 2 workers: 2*1/2 * 8e8 / 1e9 = 0.8 s, plus 2 ring steps' latency
    assert allreduce_seconds(100e6, 2, GIGABIT) == pytest.approx(0.802)


def test_nothing_to_exchange_costs_nothing():
    assert allreduce_seconds(100e6, 1, GIGABIT) == 0.0
    assert allreduce_seconds(0, 8, GIGABIT) == 0.0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="workers"):
        allreduce_seconds(1.0, 0, GIGABIT)
    with pytest.raises(ValueError, match="num_bytes"):
        allreduce_seconds(-1.0, 2, GIGABIT)
    with pytest.raises(ValueError, match="after the last step"):
        run_seconds(0.1, [(11, 1.0)], 2, GIGABIT, steps=10)


def test_presets_are_ordered_from_fast_to_slow():
    assert LINK_PRESETS["1gbit"].bandwidth_gbit == 1.0
    times = [allreduce_seconds(100e6, 8, link) for link in LINK_PRESETS.values()]
    assert times == sorted(times)
    assert list(LINK_PRESETS) == ["100gbit", "10gbit", "1gbit", "100mbit-cross-continent"]


def test_more_bandwidth_is_never_slower():
    times = [allreduce_seconds(50e6, 8, Link("x", gbit, 1e-4)) for gbit in (0.1, 1, 10, 100)]
    assert all(a > b for a, b in zip(times, times[1:]))


def test_states_due_at_one_step_travel_in_one_collective():
    separate = [(32, 100e6), (32, 100e6)]
    merged = [(32, 200e6)]
    assert run_seconds(0.0, separate, 4, GIGABIT, steps=32) == pytest.approx(
        run_seconds(0.0, merged, 4, GIGABIT, steps=32)
    )
    assert run_seconds(0.0, merged, 4, GIGABIT, steps=32) == pytest.approx(
        2.4 + 6e-3
    )  # 1.5 * 1.6e9 / 1e9


def test_ddp_versus_local_k32_for_a_16m_model():
    # 16M fp32 parameters, 4 workers on 1 Gbit/s (1 ms latency), 0.1 s compute per step, 320 steps.
    steps, model_bytes = 320, 64e6
    ddp = every(1, steps, model_bytes)
    # MT-DAO with N = 1 at K = 32: parameters, momentum and second moment averaged together.
    local = [
        event
        for _ in ("params", "momentum", "second_moment")
        for event in every(32, steps, model_bytes)
    ]
    ddp_s = run_seconds(0.1, ddp, 4, GIGABIT, steps=steps)
    local_s = run_seconds(0.1, local, 4, GIGABIT, steps=steps)
    # DDP: per step 1.5 * 64e6 * 8 / 1e9 = 0.768 s + 6 ms; 320 * 0.774 + 32 = 279.68 s
    assert ddp_s == pytest.approx(279.68)
    # Local: per round 1.5 * 192e6 * 8 / 1e9 = 2.304 s + 6 ms; 10 * 2.310 + 32 = 55.10 s
    assert local_s == pytest.approx(55.10)
    # Bandwidth terms alone differ by 32/3; the latency the ring pays per collective adds to DDP.
    assert (ddp_s - 32) / (local_s - 32) == pytest.approx(320 * 0.774 / 23.10)


def test_time_to_step_counts_collectives_up_to_that_step():
    local = every(32, 100, 100e6)  # steps 32, 64, 96
    round_s = allreduce_seconds(100e6, 4, GIGABIT)
    assert time_to_step(0.5, local, 4, GIGABIT, step=31) == pytest.approx(15.5)
    assert time_to_step(0.5, local, 4, GIGABIT, step=32) == pytest.approx(16.0 + round_s)
    assert time_to_step(0.5, local, 4, GIGABIT, step=100) == pytest.approx(50.0 + 3 * round_s)
    ends = step_end_times(0.5, local, 4, GIGABIT, steps=100)
    assert len(ends) == 100
    assert ends == pytest.approx(
        [time_to_step(0.5, local, 4, GIGABIT, step=s) for s in range(1, 101)]
    )
    assert run_seconds(0.5, local, 4, GIGABIT, steps=100) == pytest.approx(ends[-1])
