"""Staging a bucket: its padded input copied in (and cast), and the record of it in flight.

Owns the in-flight record of a staged bucket (``Landed``: full tensors
written in place; ``Flat``: one output to copy out),
the copy-in shared by every transport, and ``AllOf``, several
point-to-point works waited for as one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fsdp_shim._host_buffers import FullBuffers
from fsdp_shim._layout import BucketEntry, fills_padding


class Waitable(Protocol):
    """A collective's ``dist.Work``, or several point-to-point ones (``AllOf``)."""

    def wait(self) -> Any: ...


@dataclass(eq=False)
class InFlight:
    """A staged bucket, in one of two shapes (``Landed``, ``Flat``); its work until it is in.

    ``work`` is its collective or messages (``None`` once there is nothing to
    wait for, or, for a ``Flat`` bucket, until it is launched);
    ``send_buffer`` a sender's packed or cast input, kept alive until ``work``
    is done.
    """

    bucket: list[BucketEntry]
    split_sizes: list[int]  # each tensor's padded shard, in elements
    work: Waitable | None = None
    send_buffer: torch.Tensor | None = None

    def launched(self) -> InFlight:
        """This flight with its collective launched (a no-op for anything else); returns itself."""
        return self


@dataclass(eq=False)
class Landed(InFlight):
    """Full tensors written where they stay: direct messages, or a shard group of one.

    ``padded_fulls`` are the padded full tensors the transfer writes into;
    ``None`` where this rank receives nothing (``rank0_only`` elsewhere, or
    a group without the receiver).
    """

    padded_fulls: list[torch.Tensor] | None = None


@dataclass(eq=False)
class Flat(InFlight):
    """A bucket gathered into one flat output of ``W`` rank blocks, copied out afterwards.

    The all-gather, or packed messages. ``output`` is ``None`` where this
    rank receives nothing; ``launch`` holds the collective while the bucket
    is staged and not yet launched (see [Note: staged, then launched]).
    """

    output: torch.Tensor | None = None
    launch: Callable[[], Waitable] | None = None

    def launched(self) -> InFlight:
        if self.launch is not None:
            self.work, self.launch = self.launch(), None
        return self


def bucket_output(
    bucket: list[BucketEntry], numel: int, dtype: torch.dtype, device: torch.device, buffers: FullBuffers
) -> torch.Tensor:
    """A bucket's flat output: fresh, except that a bucket of one's is its full tensor, from ``buffers``."""
    if len(bucket) > 1:
        return torch.empty(numel, dtype=dtype, device=device)
    return buffers.take(numel, dtype, device)


def copy_in(
    bucket: list[BucketEntry], split_sizes: list[int], dtype: torch.dtype, device: torch.device,
    block: torch.Tensor | None, unpadded: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's padded shards, back to back: (the input, the send buffer it lives in if any).

    Packed into ``block`` (this rank's block of the output), or into a send buffer
    where this rank receives nothing. A bucket of one whose shard needs no
    padding, cast or move is its own input (see [Note: a bucket of one]).
    """
    per_rank = sum(split_sizes)
    local = bucket[0].dtensor._local_tensor
    if (len(bucket) == 1 and local.numel() == per_rank and local.dtype == dtype and local.device == device
            and local.is_contiguous()):
        return local.view(-1), None
    send_buffer = None
    if block is None:  # a sender only: a buffer of its own, kept alive until its messages are out
        block = send_buffer = torch.empty(per_rank, dtype=dtype, device=device)
    sources = [b.dtensor._local_tensor.reshape(-1) for b in bucket]  # a view where it can be
    if unpadded is None:  # not planned
        unpadded = fills_padding(bucket)
    if unpadded and sources[0].device == device:
        # no padding, no move (a bucket holds one device): one cat, casting too
        torch.cat(sources, out=block)
        return block, send_buffer
    destinations: list[torch.Tensor] = []
    for local, padded, piece in zip(sources, split_sizes, torch.split_with_sizes(block, split_sizes)):
        numel = local.numel()
        destinations.append(piece[:numel])
        if padded > numel:  # zeros: padding is never exposed, but stays deterministic
            piece[numel:].zero_()
    torch._foreach_copy_(destinations, sources, non_blocking=True)  # casts and moves in the same pass
    return block, send_buffer


class AllOf:
    """Several point-to-point works, waited for as one; idempotent.

    A gloo ``isend``/``irecv`` work waited for a second time blocks forever
    (it waits for one more completion), so each work is dropped once done.
    """

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        while self._works:
            self._works[0].wait()
            del self._works[0]
        return True
