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
from torch import Tensor

from mtdao.sync.dtensors import local_shard
from mtdao.sync.quantize import Codec
from mtdao.sync.transport import StackedTransport, Transport


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
    """The encoded means over ``contributors`` of encoded chunks ``[R, workers, ..., bytes]``
    (each local worker's chunk from every worker): decoded, summed in worker order, divided,
    encoded (the same operations wherever it runs): ``[R, ..., bytes]``."""
    decoded = codec.decode(received)
    total = decoded[:, contributors[0]].clone()
    for worker in contributors[1:]:
        total += decoded[:, worker]
    return codec.encode(total / len(contributors))


def simulated_mean(
    rows: Sequence[Tensor], codec: Codec, excluded: Sequence[int] = ()
) -> tuple[list[Tensor], BlockLayout]:
    """The quantized mean of stacked tensors (rows ``[M, numel]``), as M real workers compute it."""
    exchange = InFlightQuantizedMean(rows, codec, StackedTransport(rows[0].shape[0]), excluded)
    return exchange.flat_means(), exchange.layout


class InFlightQuantizedMean:
    """The quantized mean over a transport, in two stages: the all-to-all is launched at once;
    :meth:`advance` reduces this process's chunks and launches the all-gather; :meth:`wait`
    finishes (running whatever stage has not run yet). ``tensors`` are this process's values
    (local shards: a sharded worker's processes each encode their own), with the transport's
    local workers along dim 0 when it holds several (the simulator)."""

    def __init__(
        self,
        tensors: Sequence[Tensor],
        codec: Codec,
        transport: Transport,
        excluded: Sequence[int] = (),
        contributes: bool = True,
    ) -> None:
        self.codec, self.transport = codec, transport
        tensors = [local_shard(t) for t in tensors]
        rows = transport.local_workers
        self.shapes = [(t.shape[1:] if transport.stacked else t.shape, t.dtype) for t in tensors]
        self.num_workers = transport.num_workers
        self.contributors = transport.contributors(excluded, contributes)
        flat = [t.reshape(rows, -1) for t in tensors]
        self.layout = BlockLayout(tuple(t.shape[1] for t in flat), codec.block, self.num_workers)
        payload = codec.encode(pack(flat, self.layout))  # [R, blocks, bytes]
        chunks = payload.view(rows, self.num_workers, self.layout.chunk_blocks, -1)
        self.work = transport.all_to_all(chunks)
        self.gathering = False
        self.collectives = 2

    def advance(self) -> None:
        if self.gathering:
            return
        received = self.work.wait()[0]  # [R, M workers, chunk blocks, bytes]
        mean = reduce_chunks(received, self.codec, self.contributors)
        self.work = self.transport.all_gather(mean)
        self.gathering = True

    def flat_means(self) -> list[Tensor]:
        """Each tensor's mean, flat."""
        self.advance()
        gathered = self.work.wait()[0]  # [M chunks, chunk blocks, bytes]
        decoded = self.codec.decode(gathered).view(self.layout.total_blocks, -1)
        return unpack(decoded, self.layout)

    def wait(self) -> list[Tensor]:
        values = self.flat_means()
        return [v.view(shape).to(dtype) for v, (shape, dtype) in zip(values, self.shapes)]
