"""Staging a bucket: its padded input copied in (and cast), and the record of it in flight.

Owns the in-flight record of a staged bucket (``InPlace``: full tensors
already in place; ``AllGatherFlight``: one all-gather output to copy out) and the
copy-in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fsdp_shim._gather.layout import BucketEntry, fills_padding


class Waitable(Protocol):
    """A collective's ``dist.Work``."""

    def wait(self) -> Any: ...


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

    def launched(self) -> InFlight:
        """This flight with its collective launched (a no-op for anything else); returns itself."""
        return self


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

    def launched(self) -> InFlight:
        if self.launch is not None:
            self.work, self.launch = self.launch(), None
        return self


def copy_in(
    bucket: list[BucketEntry], split_sizes: list[int], dtype: torch.dtype, device: torch.device,
    block: torch.Tensor, unpadded: bool | None = None, host_copies: list[Any] | None = None,
) -> torch.Tensor:
    """This rank's padded shards, back to back, in ``block`` (its block of the output): the all-gather's input.

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
    if unpadded is None:  # not planned
        unpadded = fills_padding(bucket)
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
