"""Where full tensors' memory comes from: fresh (``FullBuffers``) or, for the stream, recycled.

Only CPU memory is ever recycled: accelerators' caching allocators reuse
memory already. Nothing recycled is handed to a caller while anything else
can still see it.

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

from collections.abc import Sequence

import torch

from fsdp_shim._compat import storage_use_count


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
