"""The quantized average: each worker's encoded chunks reduced by their owner, the encoded means
gathered by every worker; or, for a sparse (top-k) payload, every worker's payload gathered whole.

For M workers and one codec, each worker lays its tensors out as blocks (:class:`BlockLayout`:
each tensor padded to whole blocks, the whole padded to a multiple of M blocks) and encodes them.
Chunk c (the c-th of M equal runs of blocks) of every worker goes to worker c (an all-to-all),
which decodes the M chunks, sums them in worker order, divides by the number of contributors and
encodes the mean (:func:`reduce_chunks`); an all-gather then hands every worker every encoded mean
chunk, and all of them decode the same bytes. So every worker ends the round with bit-identical
values, and the simulator, which runs the same functions on the same blocks, with the same ones.

A top-k payload is not reduced by an owner (:class:`InFlightGatheredMean`): every worker gathers
every worker's payload, decodes each and sums them in worker order, since encoding the mean to k
again would drop most of it. What each exchange costs on the wire, and how the traffic account
counts it: docs/design.md ("Quantized payloads").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.dtensors import local_shard
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


def block_layout(numels: Sequence[int], codec: Codec, num_workers: int) -> BlockLayout:
    """How one codec's payload is laid out: in M equal chunks for an owner each, or (a gathered
    payload) as one run of blocks."""
    return BlockLayout(tuple(numels), codec.block, 1 if codec.gathered else num_workers)


def counted_bytes(payload_bytes: int, codec: Codec, num_workers: int) -> int:
    """What the traffic account counts for sending a payload of ``payload_bytes``: the payload
    (reduced by owners: 2 (M-1)/M x it on the wire, an all-reduce's factor), or M/2 x it
    (gathered whole: (M-1) x it on the wire). A top-k block is 2k + 4 bytes, so exact."""
    return payload_bytes * num_workers // 2 if codec.gathered else payload_bytes


def payload_sizes(
    parts: Sequence[Sequence[int]],
    kinds: Sequence[str],
    codec: Codec,
    num_workers: int,
    process: int = 0,
) -> tuple[list[tuple[str, int]], int]:
    """What one worker sends in one codec's exchange, as the traffic account counts it
    (:func:`counted_bytes`): (kind, bytes) per tensor, summed over the worker's processes, and
    the bytes of its process ``process``. ``parts[i]`` holds the elements of tensor i that each
    process holds: every process encodes its own (a sharded worker's processes their shards,
    padded to whole blocks, and to equal chunks where owners reduce them, each)."""
    per_process = [
        [
            (kind, counted_bytes(size, codec, num_workers))
            for kind, size in block_layout(numels, codec, num_workers).kind_bytes(kinds, codec)
        ]
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


def decoded_mean(payloads: Tensor, codec: Codec, contributors: Sequence[int]) -> Tensor:
    """The mean over ``contributors`` of encoded payloads ``[..., workers, ..., bytes]`` (the
    workers along dim ``-3``): each decoded, summed in worker order, divided (the same
    operations wherever it runs, one worker's payload decoded at a time): ``[..., ..., block]``."""
    total = codec.decode(payloads.select(-3, contributors[0]))
    for worker in contributors[1:]:
        total += codec.decode(payloads.select(-3, worker))
    return total / len(contributors)


def reduce_chunks(received: Tensor, codec: Codec, contributors: Sequence[int]) -> Tensor:
    """The encoded means over ``contributors`` of encoded chunks ``[R, workers, blocks, bytes]``
    (each local worker's chunk from every worker): ``[R, blocks, bytes]``."""
    return codec.encode(decoded_mean(received, codec, contributors))


def simulated_mean(
    rows: Sequence[Tensor], codec: Codec, excluded: Sequence[int] = ()
) -> tuple[list[Tensor], BlockLayout]:
    """The quantized mean of stacked tensors (rows ``[M, numel]``), as M real workers compute it."""
    exchange = quantized_mean(rows, codec, StackedTransport(rows[0].shape[0]), excluded)
    return exchange.flat_means(), exchange.layout


def quantized_mean(
    tensors: Sequence[Tensor],
    codec: Codec,
    transport: Transport,
    excluded: Sequence[int] = (),
    contributes: bool = True,
) -> InFlightQuantizedMean | InFlightGatheredMean:
    """The exchange ``codec`` takes, launched (reduced by owners, or gathered whole)."""
    exchange = InFlightGatheredMean if codec.gathered else InFlightQuantizedMean
    return exchange(tensors, codec, transport, excluded, contributes)


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
        self._launch(self._encode(tensors, codec, transport, excluded, contributes))

    def _launch(self, payload: Tensor) -> None:
        """The first collective: each owner's chunk of every worker's payload."""
        rows = self.transport.local_workers
        chunks = payload.view(rows, self.num_workers, self.layout.chunk_blocks, -1)
        self.work = self.transport.all_to_all(chunks)
        self.gathering = False
        self.collectives = 2

    def _encode(self, tensors, codec, transport, excluded, contributes) -> Tensor:
        """This process's payload ``[R, blocks, bytes]``, and what decoding the result needs."""
        self.codec, self.transport = codec, transport
        tensors = [local_shard(t) for t in tensors]
        self.shapes = [(t.shape[1:] if transport.stacked else t.shape, t.dtype) for t in tensors]
        self.num_workers = transport.num_workers
        self.contributors = transport.contributors(excluded, contributes)
        flat = [t.reshape(transport.local_workers, -1) for t in tensors]
        self.layout = block_layout([t.shape[1] for t in flat], codec, self.num_workers)
        return codec.encode(pack(flat, self.layout))

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


class InFlightGatheredMean(InFlightQuantizedMean):
    """The mean of payloads gathered whole (top-k), in one stage: every worker's payload is
    gathered at once; :meth:`wait` decodes each, sums them in worker order and divides. Nothing
    is encoded twice, so the mean is exactly the mean of what the workers sent."""

    def _launch(self, payload: Tensor) -> None:
        """The only collective: every worker's payload, whole."""
        self.work = self.transport.all_gather(payload)
        self.collectives = 1

    def advance(self) -> None:
        """Nothing to launch later: one stage."""

    def flat_means(self) -> list[Tensor]:
        gathered = self.work.wait()[0]  # [M workers, blocks, bytes]
        return unpack(decoded_mean(gathered, self.codec, self.contributors), self.layout)
