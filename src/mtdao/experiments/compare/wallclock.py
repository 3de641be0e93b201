"""A wall-clock model of training with communication: measured compute plus modelled all-reduces.

A run is what a training log holds: compute seconds per step (measured) and a list of collective
events ``(step, num_bytes)``, where ``num_bytes`` is the buffer each worker contributes to the
all-reduce (e.g. 4 bytes per parameter for fp32 gradients). States due at the same step travel in
one collective, so events sharing a step are merged before costing.

Cost of one ring all-reduce of n bytes over M workers (alpha-beta model, Thakur et al. 2005):

    2 (M - 1) * latency  +  2 (M - 1) / M * 8 n / bandwidth

The ring has 2(M - 1) dependent steps (reduce-scatter then all-gather) and each one waits for a
message from its neighbour, so latency is charged per ring step. Compute and communication are
assumed not to overlap, which flatters nobody:
DDP can hide some of its all-reduce behind the backward pass, local methods can hide theirs too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A network between workers."""

    name: str
    bandwidth_gbit: float
    """Per-worker bandwidth in Gbit/s (1e9 bits per second)."""
    latency_s: float
    """Cost of one message, in seconds, charged at every step of the ring."""


LINK_PRESETS: dict[str, Link] = {
    link.name: link
    for link in (
        # InfiniBand / RoCE inside one cluster: RDMA message latency of a few microseconds.
        Link("100gbit", 100.0, 5e-6),
        # Datacenter Ethernet through the kernel TCP stack: tens of microseconds per message.
        Link("10gbit", 10.0, 25e-6),
        # Commodity Gigabit Ethernet LAN with TCP: ~50 us one way (a ~0.1 ms ping).
        Link("1gbit", 1.0, 50e-6),
        # Training across datacenters on two continents: a transcontinental round trip is 60-100 ms
        # and a TCP message is only usable once acknowledged, so ~80 ms per message.
        Link("100mbit-cross-continent", 0.1, 80e-3),
    )
}


def allreduce_seconds(num_bytes: float, workers: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``num_bytes`` per worker over ``workers`` on ``link``."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    if workers == 1 or num_bytes == 0:
        return 0.0  # nothing to exchange
    ring_steps = 2 * (workers - 1)
    latency = link.latency_s * ring_steps
    return latency + ring_steps / workers * num_bytes * 8 / (link.bandwidth_gbit * 1e9)


def _bytes_by_step(collectives: Iterable[tuple[int, float]]) -> dict[int, float]:
    merged: dict[int, float] = {}
    for step, num_bytes in collectives:
        if step < 1:
            raise ValueError(f"collective steps count from 1, got step {step}")
        merged[step] = merged.get(step, 0.0) + num_bytes
    return merged


def step_end_times(
    compute_s_per_step: float,
    collectives: Iterable[tuple[int, float]],
    workers: int,
    link: Link,
    *,
    steps: int,
) -> list[float]:
    """Modelled seconds at which steps 1..``steps`` complete (entry i is step i + 1).

    A collective at step t counts towards step t: DDP's gradient all-reduce precedes that step's
    update, a local method's averaging ends that round.
    """
    by_step = _bytes_by_step(collectives)
    times, now = [], 0.0
    for step in range(1, steps + 1):
        now += compute_s_per_step
        if step in by_step:
            now += allreduce_seconds(by_step[step], workers, link)
        times.append(now)
    return times


def time_to_step(
    compute_s_per_step: float,
    collectives: Iterable[tuple[int, float]],
    workers: int,
    link: Link,
    *,
    step: int,
) -> float:
    """Modelled seconds at which ``step`` completes, e.g. when a method first reaches a target loss."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    communication = sum(
        allreduce_seconds(num_bytes, workers, link)
        for event_step, num_bytes in _bytes_by_step(collectives).items()
        if event_step <= step
    )
    return step * compute_s_per_step + communication


def run_seconds(
    compute_s_per_step: float,
    collectives: Iterable[tuple[int, float]],
    workers: int,
    link: Link,
    *,
    steps: int,
) -> float:
    """Modelled seconds for a whole run of ``steps`` steps with the logged ``collectives``."""
    by_step = _bytes_by_step(collectives)
    late = [step for step in by_step if step > steps]
    if late:
        raise ValueError(f"collectives logged after the last step {steps}: steps {sorted(late)}")
    return time_to_step(compute_s_per_step, by_step.items(), workers, link, step=steps)
