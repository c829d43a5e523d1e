"""Host buffers: the CPU memory a gather reuses instead of asking the allocator afresh.

Owns the per-thread scratch pool (bucket outputs and senders' inputs) and
the stream's recycled full-tensor buffers. Only CPU memory is ever kept:
accelerators' caching allocators reuse memory already. Nothing kept is
handed to a caller while anything else can still see it.

[Note: scratch buffers]
A multi-tensor bucket's output buffer is scratch: every full tensor is
copied out of it. On the CPU a fresh buffer of a few MiB comes from ``mmap``
each time (glibc maps a request as large as the last freed one anew), and
touching it costs page faults. So each thread keeps its last few CPU scratch
buffers, by size, and a per-unit loop over identical blocks reuses one. At
most ``ScratchPool.KEEP`` buffers of at most a bucket (plus padding) each
stay allocated. Buffers handed out as full tensors are never scratch, and a
buffer made under ``inference_mode`` is never kept (a copy into it outside
that mode would be refused).

[Note: recycled buffers]
A stream's full tensors are valid until its next step, so it can reuse
their memory. Each batch allocates the full tensors it writes at staging
(point to point, a bucket of one, a group of one) through a
``RecycledBuffers`` that may take the buffers of the batch two steps before
it, the one handed out at the last step. A buffer is taken only for a
request of its exact size, dtype and device, and only while its storage's
use count is what it was when the buffer was alone: a tensor, a view or a
pending ``Work`` a caller still holds keeps it out, so a caller that keeps
tensors past their step (against the documented contract) gets fresh memory
and correct values, never a buffer written under it. What the batch did not
take is freed once it is staged, or sooner, at the first request none of
them has the size for, so the stream's memory bound is unchanged. The
summon does not recycle: its full tensors are freed at exit, as FSDP1's
are. Measured gains: ``docs/gather-engine.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from fsdp_shim._compat import storage_use_count


class ScratchPool(threading.local):
    """Bucket outputs kept for reuse on the CPU, per thread. See [Note: scratch buffers]."""

    KEEP = 4  # buffers, most recently used first out

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            buffer = self.free.pop((numel, dtype), None)
            if buffer is not None:
                return buffer
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            return  # accelerators' caching allocators already reuse memory
        if buffer.is_inference():
            return  # made under inference_mode: outside it, the next copy into it would be refused
        self.free[(buffer.numel(), buffer.dtype)] = buffer
        while len(self.free) > self.KEEP:
            del self.free[next(iter(self.free))]


scratch_pool = ScratchPool()


class FullBuffers:
    """Where a bucket's full tensors are allocated when it is staged: fresh memory, each time."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)


FRESH_BUFFERS = FullBuffers()


class RecycledBuffers(FullBuffers):
    """Full tensors' buffers for one batch of a stream, reusing an earlier batch's nobody holds any more.

    ``earlier`` are buffers an earlier batch took (its ``taken``), each with
    its storage's use count when it was alone. One is reused for a request
    of its exact size, dtype and device only while its use count is still
    that: no tensor, view or ``Work`` outside holds it. A request none of
    them has the size for frees them all first.
    See [Note: recycled buffers].
    """

    def __init__(self, earlier: Sequence[tuple[torch.Tensor, int]] = ()) -> None:
        self._earlier = list(earlier)
        #: Every CPU buffer this batch took, with its use count when alone: the next batches' ``earlier``.
        self.taken: list[tuple[torch.Tensor, int]] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        wanted = (numel, dtype, device)
        sized = [i for i, (b, _) in enumerate(self._earlier) if (b.numel(), b.dtype, b.device) == wanted]
        if not sized:  # another structure: the earlier buffers are freed before fresh memory is taken
            self._earlier = []
        inference = torch.is_inference_mode_enabled()
        for index in sized:
            buffer, alone = self._earlier[index]
            if buffer.is_inference() and not inference:
                continue  # made under inference_mode, which has ended: no in-place copy into it now
            if storage_use_count(buffer) == alone:  # nothing outside holds it
                del self._earlier[index]
                self.taken.append((buffer, alone))
                return buffer
        buffer = super().take(numel, dtype, device)
        count = storage_use_count(buffer) if device.type == "cpu" else None
        if count is not None:  # accelerators' caching allocators reuse memory already
            self.taken.append((buffer, count))
        return buffer

    def forget_earlier(self) -> None:
        """Free the earlier buffers no request took."""
        self._earlier = []
