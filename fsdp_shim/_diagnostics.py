"""Warnings once per process group, not once per rank.

A job of N ranks runs the same code N times; a warning every rank repeats says
nothing new. The *leader* speaks for its group: the lowest global rank of the
mesh a warning is about, else global rank 0, else (no process group yet, as
at import under torchrun) the process whose ``RANK`` is 0 or unset. Debug and
info lines stay per rank: they describe what that rank did.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger("fsdp_shim")


def is_leader(mesh: DeviceMesh | None = None) -> bool:
    """Whether this process speaks for its group (see the module docstring)."""
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError:
        dist = None  # type: ignore[assignment]
    if dist is not None and dist.is_available() and dist.is_initialized():
        if mesh is not None:
            return dist.get_rank() == int(mesh.mesh.min())
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def warn(message: str, *, stacklevel: int, mesh: DeviceMesh | None = None) -> None:
    """``warnings.warn(message, UserWarning)`` on the leader only; ``stacklevel`` as seen by the caller."""
    if is_leader(mesh):
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def log_warning(message: str, *args: Any, mesh: DeviceMesh | None = None) -> None:
    """``logger.warning`` on the leader only."""
    if is_leader(mesh):
        logger.warning(message, *args)
