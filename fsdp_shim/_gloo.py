"""The point-to-point transport: how buckets move on gloo.

Owns the messages: which ranks send what to whom, their tags, and the
choice between packed and direct buckets.

[Note: point to point]
On gloo (CPU) no bucket moves by a collective: each is sent with
``isend``/``irecv`` from the ranks that hold shards to the ranks that
receive, every rank of the group (``receiver="all"``) or one
(``rank0_only``). gloo's all-gather and gather each collect into a flat
tensor of their own and copy it into the output, and are slower on the wire
besides. Two forms, chosen per bucket by message size:

* *Direct*, when a bucket's tensors average at least ``DIRECT_BYTES`` of
  shard a rank: each receiver allocates each padded full tensor and posts
  one receive per (tensor, sender) straight into that sender's rows; every
  rank sends each shard, as it is, to every other receiver. Nothing is
  copied but a receiver's own rows. ``plan_buckets`` gives a tensor with at
  least ``ALONE_BYTES`` of shard a bucket of its own here, so a large
  tensor is always sent direct, never packed with small ones and copied
  out again.
* *Packed* otherwise, since a message has a fixed cost: each rank packs its
  padded shards as for an all-gather (a receiver into its own block of the
  output) and sends the block to every other receiver, which posts one
  receive per sender straight into that sender's block; the output is
  copied out as an all-gather's is.

Both sides derive every message from global metadata and post them in
program order, so they agree: a packed bucket's messages carry one tag
(``PACKED_TAG``), a direct bucket's tensor ``i`` that tag ``+ 1 + i``, and
messages with one tag between two ranks match in order. They are outside
the group's collective order, so they are posted as soon as a bucket is
staged (see [Note: staged, then launched] in ``_engine``). On other
backends the all-gather stays (``_layout.moves_point_to_point``), as in
FSDP1 and FSDP2. ``global_rank0`` (``iter_full_params``) skips, on every
rank of it, a group that does not contain global rank 0: under HSDP only
global rank 0's replica moves anything. Measured: ``docs/gather-engine.md``.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.distributed as dist

from fsdp_shim._host_buffers import FullBuffers
from fsdp_shim._layout import rows_held
from fsdp_shim._staging import AllOf, BucketEntry, Flat, InFlight, Landed, bucket_output, copy_in


#: Each message of a bucket that carries at least this many bytes on average
#: goes straight between shard and full tensor; below it, the bucket is packed.
#: See [Note: point to point].
DIRECT_BYTES = 1 << 20
#: The tag of a packed bucket's messages; a direct bucket tags tensor ``i``'s
#: ``PACKED_TAG + 1 + i``. Far from 0, the tag other code on the same group
#: most likely uses, so a receive someone else left posted never takes ours.
PACKED_TAG = 0x46530000


class BucketMessages(NamedTuple):
    """How one bucket moves point to point, worked out once when the engine stages it."""

    split_sizes: list[int]  # each tensor's padded shard, in elements
    dtype: torch.dtype  # what travels: the stored dtype, or the cast one
    device: torch.device  # where it travels from and lands
    receivers: range  # the group ranks that receive full tensors
    global_ranks: list[int]  # the group's ranks, by group rank
    buffers: FullBuffers  # where full tensors written in place come from


def post_packed(bucket: list[BucketEntry], messages: BucketMessages) -> InFlight:
    """Move the packed bucket point to point: one message per (sender, receiver). See [Note: point to point].

    A receiver posts its receives straight into the senders' blocks of its
    output, then packs its own block; every rank then sends its block, as it
    is, to every other receiver. The output is then copied out as an
    all-gather's would be.
    """
    first = bucket[0].layout
    group, world_size, rank = first.group, first.world_size, first.rank
    ranks = messages.global_ranks
    per_rank = sum(messages.split_sizes)
    works: list[dist.Work] = []
    output = block = None
    if rank in messages.receivers:
        output = bucket_output(bucket, world_size * per_rank, messages.dtype, messages.device, messages.buffers)
        for source in range(world_size):
            if source != rank:
                piece = output.narrow(0, source * per_rank, per_rank)
                works.append(cast(dist.Work, dist.irecv(piece, src=ranks[source], group=group, tag=PACKED_TAG)))
        block = output.narrow(0, rank * per_rank, per_rank)
    packed, send_buffer = copy_in(bucket, messages.split_sizes, messages.dtype, messages.device, block)
    for peer in messages.receivers:
        if peer != rank:
            works.append(cast(dist.Work, dist.isend(packed, dst=ranks[peer], group=group, tag=PACKED_TAG)))
    if block is not None and packed is not block:  # a bucket of one sent as it is: its own rows still land here
        block.copy_(packed)
    return Flat(bucket, messages.split_sizes, AllOf(works), send_buffer, output=output)


def post_direct(bucket: list[BucketEntry], messages: BucketMessages) -> InFlight:
    """Send every shard straight into the receivers' full tensors. See [Note: point to point].

    A receiver (``messages.receivers``) allocates each padded full tensor and
    posts one receive per (tensor, sender) straight into that sender's rows;
    every rank sends each shard, as it is (or cast into a send buffer, each sent
    as soon as it is cast), to every other receiver; a receiver then copies
    its own shards into its rows, while the messages move. Rows a rank does
    not hold (an empty trailing shard) travel on neither side. Both sides
    derive every message from global metadata, so they agree; a tensor's tag
    is its place in the bucket, and messages with one tag between two ranks
    match in order.
    """
    first = bucket[0].layout
    group, world_size, rank = first.group, first.world_size, first.rank
    dtype, device = messages.dtype, messages.device
    works: list[dist.Work] = []
    padded_fulls: list[torch.Tensor] | None = None
    own_destinations: list[torch.Tensor] = []
    own_sources: list[torch.Tensor] = []
    if rank in messages.receivers:
        padded_fulls = [messages.buffers.take(world_size * padded, dtype, device) for padded in messages.split_sizes]
        for tag, (b, full) in enumerate(zip(bucket, padded_fulls), start=PACKED_TAG + 1):
            layout, rows = b.layout, b.dtensor.shape[0]
            for source in range(world_size):
                held = rows_held(rows, layout.chunk_rows, source)
                if held == 0:
                    continue
                piece = full.narrow(0, source * layout.padded_numel, held * layout.row_numel)
                if source == rank:
                    own_destinations.append(piece)
                    own_sources.append(b.dtensor._local_tensor.reshape(-1))
                else:
                    works.append(cast(dist.Work, dist.irecv(piece, src=messages.global_ranks[source], group=group, tag=tag)))
    peers = [messages.global_ranks[peer] for peer in messages.receivers if peer != rank]
    send_buffer = None
    if peers:
        pieces = [b.dtensor._local_tensor.reshape(-1) for b in bucket]
        converted = [t.numel() > 0 and not (t.dtype == dtype and t.device == device) for t in pieces]
        if any(converted):  # cast (or moved) into a send buffer, kept alive until the sends are done
            send_buffer = torch.empty(sum(t.numel() for t, c in zip(pieces, converted) if c), dtype=dtype,
                                      device=device)
        offset = 0
        for tag, (piece, convert) in enumerate(zip(pieces, converted), start=PACKED_TAG + 1):
            if convert:  # each shard goes as soon as it is cast: the first is on the wire while the next casts
                assert send_buffer is not None
                staged = send_buffer.narrow(0, offset, piece.numel())
                staged.copy_(piece, non_blocking=True)
                piece, offset = staged, offset + piece.numel()
            if piece.numel():
                for peer in peers:
                    works.append(cast(dist.Work, dist.isend(piece, dst=peer, group=group, tag=tag)))
    if own_destinations:  # after the messages are posted, so it overlaps them
        torch._foreach_copy_(own_destinations, own_sources, non_blocking=True)  # casts and moves too
    return Landed(bucket, messages.split_sizes, AllOf(works), send_buffer, padded_fulls=padded_fulls)


def post_point_to_point(bucket: list[BucketEntry], messages: BucketMessages) -> InFlight:
    """Post ``bucket``'s messages: direct when its shards average ``DIRECT_BYTES`` or more, else packed."""
    if sum(messages.split_sizes) * messages.dtype.itemsize >= DIRECT_BYTES * len(bucket):
        return post_direct(bucket, messages)
    return post_packed(bucket, messages)
