"""The quantized average: each worker's encoded chunks reduced by their owner, the encoded means
gathered by every worker; or, for a sparse (top-k) payload, every worker's payload gathered whole.

For M workers and one codec, each worker lays its tensors out as blocks (:class:`BlockLayout`:
each tensor padded to whole blocks, the whole padded to a multiple of M blocks) and encodes them.
Chunk c (the c-th of M equal runs of blocks) of every worker goes to worker c (an all-to-all),
which decodes the M chunks, sums them in worker order, divides by the number of contributors and
encodes the mean (:func:`reduce_chunks`); an all-gather then hands every worker every encoded mean
chunk, and all of them decode the same bytes. So every worker ends the round with bit-identical
values, and the simulator, which runs the same functions on the same blocks, with the same ones.
Several codecs share the two collectives: each owner's chunks of every codec travel side by side.

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
    exchange = quantized_mean([(rows, codec)], StackedTransport(rows[0].shape[0]), excluded)
    return exchange.flat_means()[0], exchange.groups[0].layout


def quantized_mean(
    groups: Sequence[tuple[Sequence[Tensor], Codec]],
    transport: Transport,
    excluded: Sequence[int] = (),
    contributes: bool = True,
) -> InFlightQuantizedMean | InFlightGatheredMean:
    """The exchange the codecs take, launched: the dense ones reduced by owners, together; a
    top-k codec (one group) gathered whole."""
    gathered = [codec.gathered for _, codec in groups]
    if any(gathered) and len(groups) > 1:
        raise ValueError("a gathered (top-k) payload travels in an exchange of its own")
    exchange = InFlightGatheredMean if gathered[0] else InFlightQuantizedMean
    return exchange(groups, transport, excluded, contributes)


@dataclass
class EncodedGroup:
    """One codec's tensors as this process encoded them: the payload ``[R, blocks, bytes]``, and
    what decoding the mean needs (the layout, each tensor's shape and dtype)."""

    codec: Codec
    layout: BlockLayout
    shapes: list[tuple[torch.Size, torch.dtype]]
    payload: Tensor

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one owner's chunk (the whole payload when gathered)."""
        return self.layout.chunk_blocks * self.codec.block_bytes

    def values(self, flat_means: list[Tensor]) -> list[Tensor]:
        return [v.view(shape).to(dtype) for v, (shape, dtype) in zip(flat_means, self.shapes)]


def encode_group(tensors: Sequence[Tensor], codec: Codec, transport: Transport) -> EncodedGroup:
    """This process's values (local shards: a sharded worker's processes each encode their own,
    with the transport's local workers along dim 0 when it holds several), encoded."""
    tensors = [local_shard(t) for t in tensors]
    shapes = [(t.shape[1:] if transport.stacked else t.shape, t.dtype) for t in tensors]
    flat = [t.reshape(transport.local_workers, -1) for t in tensors]
    layout = block_layout([t.shape[1] for t in flat], codec, transport.num_workers)
    return EncodedGroup(codec, layout, shapes, codec.encode(pack(flat, layout)))


def joined(parts: Sequence[Tensor]) -> Tensor:
    """Buffers ``[..., n_i]`` side by side along the last dim (one of them: itself, uncopied)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class InFlightQuantizedMean:
    """The quantized means of one or more codecs' tensors over a transport, in two stages that
    carry every codec at once (one all-to-all, one all-gather a round, however many codecs: over
    a long link a collective costs its round trips more than its bytes). The all-to-all is
    launched at once; :meth:`advance` reduces this process's chunks and launches the all-gather;
    :meth:`wait` finishes (running whatever stage has not run yet) and gives every group's
    tensors' means, group after group."""

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[Tensor], Codec]],
        transport: Transport,
        excluded: Sequence[int] = (),
        contributes: bool = True,
    ) -> None:
        self.transport, self.num_workers = transport, transport.num_workers
        self.contributors = transport.contributors(excluded, contributes)
        self.groups = [encode_group(tensors, codec, transport) for tensors, codec in groups]
        self._launch()

    def _launch(self) -> None:
        """The first collective: each owner's chunk of every codec's payload, side by side."""
        rows = self.transport.local_workers
        chunks = [group.payload.view(rows, self.num_workers, -1) for group in self.groups]
        self.work = self.transport.all_to_all(joined(chunks))
        self.gathering = False
        self.collectives = 2

    def _split(self, buffer: Tensor) -> list[Tensor]:
        """A buffer ``[..., every group's chunk bytes]`` -> ``[..., chunk blocks, bytes]`` each."""
        parts, offset = [], 0
        for group in self.groups:
            part = buffer[..., offset : offset + group.chunk_bytes]
            parts.append(part.reshape(*part.shape[:-1], -1, group.codec.block_bytes))
            offset += group.chunk_bytes
        return parts

    def advance(self) -> None:
        if self.gathering:
            return
        received = self.work.wait()[0]  # [R, M workers, every group's chunk bytes]
        means = [
            reduce_chunks(chunks, group.codec, self.contributors).flatten(1)
            for group, chunks in zip(self.groups, self._split(received))
        ]
        self.work = self.transport.all_gather(joined(means))
        self.gathering = True

    def flat_means(self) -> list[list[Tensor]]:
        """Each group's tensors' means, flat."""
        self.advance()
        gathered = self.work.wait()[0]  # [M chunks, every group's chunk bytes]
        return [
            unpack(group.codec.decode(chunks).view(group.layout.total_blocks, -1), group.layout)
            for group, chunks in zip(self.groups, self._split(gathered))
        ]

    def wait(self) -> list[Tensor]:
        means = self.flat_means()
        return [value for group, flat in zip(self.groups, means) for value in group.values(flat)]


class InFlightGatheredMean(InFlightQuantizedMean):
    """The mean of payloads gathered whole (top-k, one codec), in one stage: every worker's
    payload is gathered at once; :meth:`wait` decodes each, sums them in worker order and
    divides. Nothing is encoded twice, so the mean is exactly the mean of what the workers sent."""

    def _launch(self) -> None:
        """The only collective: every worker's payload, whole."""
        self.work = self.transport.all_gather(self.groups[0].payload)
        self.collectives = 1

    def advance(self) -> None:
        """Nothing to launch later: one stage."""

    def flat_means(self) -> list[list[Tensor]]:
        gathered = self.work.wait()[0]  # [M workers, blocks, bytes]
        group = self.groups[0]
        return [unpack(decoded_mean(gathered, group.codec, self.contributors), group.layout)]
