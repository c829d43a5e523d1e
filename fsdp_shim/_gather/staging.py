"""Staging a bucket: its padded input copied in (and cast), and the record of it in flight.

Owns staging a bucket (``stage_bucket``: the output allocated, the copy-in,
the all-gather held until launched) and the in-flight record of a staged
bucket (``InPlace``: full tensors already in place; ``AllGatherFlight``: one
all-gather output to copy out). The engine (``_gather.engine``) drives them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from fsdp_shim._compat import all_gather_single
from fsdp_shim._gather.layout import BucketEntry, BucketShape, Receiver, delivers_over


class Waitable(Protocol):
    """A collective's ``dist.Work``."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


@dataclass(eq=False)
class InFlight:
    """A staged bucket, in one of two shapes (``InPlace``, ``AllGatherFlight``); its collective until it is in.

    ``work`` is its launched collective (``None`` where there is none, or
    until it is launched); everything the collective reads or writes is
    held here until ``work`` is waited for (see [Note: every posted work
    is waited for] in ``_gather.engine``).
    """

    bucket: list[BucketEntry]
    split_sizes: list[int]  # each tensor's padded shard, in elements
    work: Waitable | None = None

    def launched(self) -> None:
        """Launch this flight's collective (a no-op for anything else)."""


@dataclass(eq=False)
class InPlace(InFlight):
    """Full tensors already where they stay, with no collective: a shard group of one, or nothing to move.

    ``padded_fulls`` are the padded full tensors; ``None`` where this rank
    receives nothing (a group without the receiver).
    """

    padded_fulls: list[torch.Tensor] | None = None


@dataclass(eq=False)
class AllGatherFlight(InFlight):
    """A bucket all-gathered into one flat output of ``W`` rank blocks, copied out afterwards.

    ``launch`` holds the collective while the bucket is staged and not yet
    launched (see [Note: staged, then launched]); ``gather_input`` is what
    it sends (this rank's block of ``output``, or a shard sent as it is),
    held until it is waited for.
    """

    output: torch.Tensor | None = None
    blocks: int = 0  # the rank blocks of ``output`` that hold rows (``BucketShape.blocks``)
    launch: Callable[[], Waitable] | None = None
    gather_input: torch.Tensor | None = None

    def launched(self) -> None:
        if self.launch is not None:
            self.work, self.launch = self.launch(), None


def copy_in(
    bucket: list[BucketEntry], split_sizes: list[int], dtype: torch.dtype, device: torch.device,
    block: torch.Tensor, unpadded: bool, host_copies: list[Any] | None = None,
) -> torch.Tensor:
    """This rank's padded shards, back to back, in ``block`` (its block of the output): the all-gather's input.
    ``unpadded``: the plan's word that every shard fills its padded size (``BucketShape.unpadded``).

    A bucket of one whose shard needs no padding, cast or move is its own
    input, and nothing is copied (see [Note: a bucket of one]).

    [Note: copy-in from host memory]
    Shards in host memory (FSDP2's ``CPUOffloadPolicy``, pinned) are moved to
    the device by a ``non_blocking`` copy, which the device runs when its
    stream reaches it: a host write to a shard before then (an optimizer step
    on the CPU shards right after the summon returns) would tear the gathered
    values. So each such copy records an event on ``host_copies``, and the
    gather synchronises the last one before it returns
    (``BucketGather._finish``): by then no copy still reads the shards. The
    copies precede their all-gathers on the stream, so the wait is short and
    the overlap of copy-in and all-gather is kept.
    """
    per_rank = sum(split_sizes)
    local = bucket[0].dtensor._local_tensor
    if (len(bucket) == 1 and local.numel() == per_rank and local.dtype == dtype and local.device == device
            and local.is_contiguous()):
        return local.view(-1)
    sources = [b.dtensor._local_tensor.reshape(-1) for b in bucket]  # a view where it can be
    if unpadded and sources[0].device == device:
        # no padding, no move (a bucket holds one device): one cat, casting too
        torch.cat(sources, out=block)
        return block
    destinations: list[torch.Tensor] = []
    for local, padded, piece in zip(sources, split_sizes, torch.split_with_sizes(block, split_sizes), strict=True):
        numel = local.numel()
        destinations.append(piece[:numel])
        if padded > numel:  # zeros: padding is never exposed, but stays deterministic
            piece[numel:].zero_()
    torch._foreach_copy_(destinations, sources, non_blocking=True)  # casts and moves in the same pass
    if host_copies is not None and device.type != "cpu" and sources[0].device.type == "cpu":
        event = getattr(torch, device.type).Event()  # see [Note: copy-in from host memory]
        event.record()
        host_copies.append(event)
    return block


_CPU = torch.device("cpu")


def comm_device_of(dtensor: DTensor) -> torch.device:
    """The device collectives on this mesh run on (CPU-offloaded shards are staged there)."""
    device_type = dtensor.device_mesh.device_type
    if device_type == "cpu":
        return _CPU
    handle = getattr(torch, device_type)
    return torch.device(device_type, handle.current_device())


def stage_bucket(bucket: list[BucketEntry], shape: BucketShape, receiver: Receiver = "all",
                 host_copies: list[Any] | None = None) -> InFlight:
    """Copy in this rank's padded shards; the bucket's collective is left for ``launched()``.

    As FSDP2 does, the input is this rank's block of the output buffer, so the
    copy-in needs no buffer of its own and the all-gather runs in place. A
    bucket of one tensor whose shard needs no padding, cast or move is sent
    as it is: no copy-in at all (see [Note: a bucket of one]).
    Called under ``no_grad``.
    """
    first = bucket[0]
    world_size, group, rank = first.layout.world_size, first.layout.group, first.layout.rank
    split_sizes, dtype = shape.split_sizes, shape.dtype
    comm_device = comm_device_of(first.dtensor)
    if not delivers_over(receiver, group):
        return InPlace(bucket, split_sizes)  # nobody on this group receives: nothing to move
    if world_size == 1:
        return _start_alone(bucket, split_sizes, dtype, comm_device)
    per_rank = sum(split_sizes)
    output = torch.empty(world_size * per_rank, dtype=dtype, device=comm_device)
    gather_input = copy_in(bucket, split_sizes, dtype, comm_device, output[rank * per_rank:(rank + 1) * per_rank],
                           shape.unpadded, host_copies)
    launch = functools.partial(all_gather_single, output, gather_input, group=group, async_op=True)
    return AllGatherFlight(bucket, split_sizes, output=output, blocks=shape.blocks, launch=launch,
                           gather_input=gather_input)


def _start_alone(
    bucket: list[BucketEntry], split_sizes: list[int], dtype: torch.dtype, device: torch.device
) -> InFlight:
    """A shard group of one rank: each full tensor is its shard, copied once.

    [Note: a group of one]
    When the shard mesh dim has one rank (one GPU, or HSDP with one shard per
    replica), nothing is exchanged: each full tensor is a fresh copy of its
    shard (cast on the way where asked), made in one ``_foreach_copy_`` per
    bucket. The copy is still needed: results never alias live shards, so
    ``writeback=False`` edits are discarded as FSDP1's ``FULL_SHARD`` discards
    them.
    """
    padded_fulls = [torch.empty(padded, dtype=dtype, device=device) for padded in split_sizes]
    torch._foreach_copy_(padded_fulls, [b.dtensor._local_tensor.reshape(-1) for b in bucket])
    return InPlace(bucket, split_sizes, padded_fulls=padded_fulls)
