"""The quantized average: each worker's encoded chunks reduced by their owner, the encoded means
gathered by every worker.

For M workers and one codec, each worker lays its tensors out as blocks (:class:`BlockLayout`:
each tensor padded to whole blocks, the whole padded to a multiple of M blocks) and encodes them.
Chunk c (the c-th of M equal runs of blocks) of every worker goes to worker c (an all-to-all),
which decodes the M chunks, sums them in worker order, divides by the number of contributors and
encodes the mean (:func:`reduce_chunks`); an all-gather then hands every worker every encoded mean
chunk, and all of them decode the same bytes. So every worker ends the round with bit-identical
values, and the simulator, which runs the same functions on the same blocks, with the same ones.

What it costs each worker on the wire: it sends (M-1)/M of its payload in the all-to-all and
(M-1)/M in the all-gather, 2 (M-1)/M x the encoded payload, like a ring all-reduce of that payload.
The traffic account counts the payload (codes, scales and padding), as it counts an all-reduce's.
Gathering every worker's whole payload and averaging locally would need no second quantization
but costs (M-1) x the payload: M/2 times more (the same at M = 2, twice as much at M = 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.sync.dtensors import local_shard
from mtdao.sync.quantize import Codec


@dataclass(frozen=True)
class BlockLayout:
    """Where each tensor's elements sit among the blocks of one codec's payload."""

    numels: tuple[int, ...]
    block: int
    num_chunks: int

    @property
    def tensor_blocks(self) -> list[int]:
        return [(n + self.block - 1) // self.block for n in self.numels]

    @property
    def total_blocks(self) -> int:
        blocks = sum(self.tensor_blocks)
        return (blocks + self.num_chunks - 1) // self.num_chunks * self.num_chunks

    @property
    def chunk_blocks(self) -> int:
        return self.total_blocks // self.num_chunks

    def kind_bytes(self, kinds: Sequence[str], codec: Codec) -> list[tuple[str, int]]:
        """(kind, payload bytes) per tensor; the padding to M equal chunks goes with the first."""
        sizes = [
            (kind, blocks * codec.block_bytes) for kind, blocks in zip(kinds, self.tensor_blocks)
        ]
        padding = (self.total_blocks - sum(self.tensor_blocks)) * codec.block_bytes
        sizes[0] = (sizes[0][0], sizes[0][1] + padding)
        return sizes


def payload_sizes(
    parts: Sequence[Sequence[int]],
    kinds: Sequence[str],
    codec: Codec,
    num_workers: int,
    process: int = 0,
) -> tuple[list[tuple[str, int]], int]:
    """What one worker sends in one codec's exchange: (kind, payload bytes) per tensor, summed
    over the worker's processes, and the payload bytes of its process ``process``. ``parts[i]``
    holds the elements of tensor i that each process holds: every process encodes its own
    (a sharded worker's processes their shards, padded to whole blocks and equal chunks each)."""
    per_process = [
        BlockLayout(tuple(numels), codec.block, num_workers).kind_bytes(kinds, codec)
        for numels in zip(*parts)
    ]
    sizes = [(kind, sum(sent[i][1] for sent in per_process)) for i, kind in enumerate(kinds)]
    return sizes, sum(size for _, size in per_process[process])


def pack(rows: Sequence[Tensor], layout: BlockLayout) -> Tensor:
    """Tensors given as rows ``[R, numel]`` (R workers, or one) -> float32 ``[R, blocks, block]``,
    zero-padded (one copy of each tensor)."""
    flat = rows[0].new_zeros(
        rows[0].shape[0], layout.total_blocks * layout.block, dtype=torch.float32
    )
    offset = 0
    for row, blocks in zip(rows, layout.tensor_blocks):
        flat[:, offset : offset + row.shape[1]] = row
        offset += blocks * layout.block
    return flat.view(flat.shape[0], layout.total_blocks, layout.block)


def unpack(blocks: Tensor, layout: BlockLayout) -> list[Tensor]:
    """``[total_blocks, block]`` -> one flat tensor of ``numel`` values per tensor."""
    flat = blocks.reshape(-1)
    values, offset = [], 0
    for numel, count in zip(layout.numels, layout.tensor_blocks):
        values.append(flat[offset : offset + numel])
        offset += count * layout.block
    return values


def reduce_chunks(received: Tensor, codec: Codec, contributors: Sequence[int]) -> Tensor:
    """The encoded mean over ``contributors`` of encoded chunks ``[workers, ..., bytes]``: decoded,
    summed in worker order, divided, encoded (the same operations wherever it runs)."""
    decoded = codec.decode(received)
    total = decoded[contributors[0]].clone()
    for worker in contributors[1:]:
        total += decoded[worker]
    return codec.encode(total / len(contributors))


def contributors(num_workers: int, excluded: Sequence[int]) -> list[int]:
    kept = [w for w in range(num_workers) if w not in set(excluded)]
    if not kept:
        raise RuntimeError("Every worker was excluded from the average")
    return kept


def simulated_mean(
    rows: Sequence[Tensor], codec: Codec, excluded: Sequence[int] = ()
) -> tuple[list[Tensor], BlockLayout]:
    """The quantized mean of stacked tensors (rows ``[M, numel]``), as M real workers compute it."""
    num_workers = rows[0].shape[0]
    layout = BlockLayout(tuple(row.shape[1] for row in rows), codec.block, num_workers)
    payloads = codec.encode(pack(rows, layout))  # [M workers, blocks, bytes]
    chunks = payloads.view(num_workers, num_workers, layout.chunk_blocks, -1)
    means = reduce_chunks(chunks, codec, contributors(num_workers, excluded))  # [M chunks, ...]
    decoded = codec.decode(means).view(layout.total_blocks, layout.block)
    return unpack(decoded, layout), layout


class InFlightQuantizedMean:
    """The quantized mean over a process group, in two stages: the all-to-all is launched at once;
    :meth:`advance` reduces this worker's chunk and launches the all-gather; :meth:`wait`
    finishes (running whatever stage has not run yet)."""

    def __init__(
        self,
        tensors: Sequence[Tensor],
        codec: Codec,
        group: dist.ProcessGroup | None,
        excluded: Sequence[int] = (),
    ) -> None:
        self.codec, self.group = codec, group
        tensors = [local_shard(t) for t in tensors]  # a sharded worker: each process its shards
        self.shapes = [(t.shape, t.dtype) for t in tensors]
        self.num_workers = dist.get_world_size(group)
        self.contributors = contributors(self.num_workers, excluded)
        self.layout = BlockLayout(tuple(t.numel() for t in tensors), codec.block, self.num_workers)
        rows = [t.reshape(1, -1) for t in tensors]
        payload = codec.encode(pack(rows, self.layout))[0]  # [blocks, bytes]
        self.received = torch.empty_like(payload)
        self.work = dist.all_to_all_single(self.received, payload, group=group, async_op=True)
        self.gathered: Tensor | None = None
        self.collectives = 2

    def advance(self) -> None:
        if self.gathered is not None:
            return
        self.work.wait()
        chunks = self.received.view(self.num_workers, self.layout.chunk_blocks, -1)
        mean = reduce_chunks(chunks, self.codec, self.contributors)
        self.gathered = torch.empty_like(self.received)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.work = gather(self.gathered, mean, group=self.group, async_op=True)

    def wait(self) -> list[Tensor]:
        self.advance()
        self.work.wait()
        decoded = self.codec.decode(self.gathered).view(self.layout.total_blocks, -1)
        values = unpack(decoded, self.layout)
        return [v.view(shape).to(dtype) for v, (shape, dtype) in zip(values, self.shapes)]
