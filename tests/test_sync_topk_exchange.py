"""Top-k rounds keep the whole mean: every worker's sparse payload is gathered and summed, not
re-sparsified by an owner; every worker decodes the same bytes; the account counts what moves."""

from __future__ import annotations

import pytest
import torch

from mtdao import MTAdam
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, unified
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.exchange import block_layout, counted_bytes, simulated_mean

BLOCK = 8


def disjoint_spikes(num_workers: int, blocks: int) -> torch.Tensor:
    """Worker w holds one non-zero per block, at position w: each one's top1 payload is exact,
    and together they fill M positions of every block."""
    rows = torch.zeros(num_workers, blocks, BLOCK)
    for worker in range(num_workers):
        rows[worker, :, worker] = 1.0 + worker
    return rows.view(num_workers, -1)


def test_the_mean_of_sparse_payloads_keeps_every_workers_mass():
    """The case a second sparsification fails: each worker's top1 keeps everything it has, but
    their mean holds M non-zeros per block; re-encoding it to top1 kept a quarter of them."""
    rows = disjoint_spikes(4, blocks=3)
    codec = Codec("top1", block=BLOCK)
    assert torch.equal(codec.roundtrip(rows), rows)  # nothing lost on the way in
    (mean,), _ = simulated_mean([rows], codec)
    assert torch.equal(mean, rows.mean(dim=0))
    assert torch.count_nonzero(mean.view(3, BLOCK), dim=-1).tolist() == [4, 4, 4]
    assert mean.sum().item() == pytest.approx(rows.sum().item() / 4)


@pytest.mark.exact
@pytest.mark.parametrize("num_workers", [2, 3, 4])
def test_the_top_k_mean_is_the_exact_mean_of_what_was_sent(num_workers):
    gen = torch.Generator().manual_seed(11)
    rows = [
        torch.randn(num_workers, 300, generator=gen),
        torch.randn(num_workers, 5, generator=gen),
    ]
    codec = Codec("top2", block=BLOCK)
    means, layout = simulated_mean(rows, codec)
    assert layout.total_blocks == sum(layout.tensor_blocks)  # one run of blocks, no padding
    for row, mean in zip(rows, means):
        sent = codec.roundtrip(row)
        expected = sent[0].clone()
        for worker in range(1, num_workers):  # summed in worker order, as every worker does
            expected += sent[worker]
        assert torch.equal(mean, expected / num_workers)
    (excluded,), _ = simulated_mean(rows[:1], codec, excluded=[1])
    kept = [w for w in range(num_workers) if w != 1]
    sent = codec.roundtrip(rows[0])
    expected = sent[kept[0]].clone()
    for worker in kept[1:]:
        expected += sent[worker]
    assert torch.equal(excluded, expected / len(kept))


def test_dense_codecs_still_reduce_by_owners():
    assert not Codec("int2", block=BLOCK).gathered and Codec("top8").gathered
    layout = block_layout([300], Codec("int8", block=BLOCK), 4)
    assert layout.num_chunks == 4 and block_layout([300], Codec("top8"), 4).num_chunks == 1


def train(codecs: SyncCodecs, num_workers: int = 4, steps: int = 8):
    gen = torch.Generator().manual_seed(3)
    targets = torch.randn(num_workers, 20, 30, generator=gen)
    weight = torch.nn.Parameter(torch.zeros(num_workers, 20, 30))
    optimizer = MTAdam([weight], lr=0.05, betas=(0.9,), omegas=(0.9,))
    sync = LocalUpdateSync(optimizer, unified(4), SimulatedWorkers(num_workers), codecs=codecs)
    for _ in range(steps):
        optimizer.zero_grad()
        (weight - targets).square().sum().backward()
        sync.step()
    return weight, optimizer, sync


@pytest.mark.parametrize("num_workers", [2, 3, 4])
def test_the_account_counts_a_gathered_payload_at_m_over_2(num_workers):
    """A worker sends its payload to M - 1 others; the account's unit is an all-reduce's payload,
    which crosses the wire 2 (M-1)/M times, so the gather counts M/2 payloads."""
    codecs = SyncCodecs.parse(["params=top8", "momenta=int8", "second-moment=int8"], True)
    weight, optimizer, sync = train(codecs, num_workers)
    payload = 3 * Codec("top8").block_bytes  # 600 values: 3 blocks, unpadded
    assert counted_bytes(payload, Codec("top8"), num_workers) * 2 == payload * num_workers
    assert sync.traffic.bytes_by_kind["params"] == 2 * payload * num_workers // 2  # two rounds
    # one collective for the top-k payload, two for the dense codecs' together (all-to-all,
    # all-gather: the momenta and the second moment side by side)
    assert sync.traffic.collectives == 2 * (1 + 2)
    for tensor in (weight, *(v for v in optimizer.state[weight].values() if v.dim() > 0)):
        assert all(torch.equal(tensor[0], tensor[w]) for w in range(1, num_workers))
