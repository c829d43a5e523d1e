"""DTensor and c10d differences between torch releases, named by behaviour (FSDP2's own are in ``_fsdp2``).

Placements are tested by exact type (``type(p) is Shard``): up to 2.9 ``_StridedShard`` subclasses ``Shard``,
and a placement the fast path does not know takes the ``full_tensor()`` path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_shim._versions import parse_version

try:  # private, but the only way to name it
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - a future torch without it
    _StridedShard = None  # type: ignore[assignment,misc]  # a class where torch has one

_TORCH = parse_version(torch.__version__)

def is_dim0_shard(placement: Placement) -> bool:
    """Exactly ``Shard(0)``: no subclass."""
    return type(placement) is Shard and placement.dim == 0


def is_replicate(placement: Placement) -> bool:
    return type(placement) is Replicate


def is_strided_shard(placement: Placement) -> bool:
    return _StridedShard is not None and isinstance(placement, _StridedShard)


#: Releases whose ``full_tensor()`` rejects a ``_StridedShard`` no other mesh dim completes (fixed in 2.12).
STRIDED_SHARD_FULL_TENSOR_BROKEN = (2, 10) <= _TORCH[:2] < (2, 12)


#: Backends whose coalesced all-gather is exact for one dtype and device (gloo's is not across dtypes); through
#: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s wrapper only from 2.13 (2.7.0 refuses it).
_COALESCING, _COALESCES_UNDER_DETAIL = ("gloo", "nccl", "fake"), _TORCH[:2] >= (2, 13)


def coalesces_all_gathers(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether one launch may post several all-gathers of ``dtype`` on ``device`` over ``group``. From the
    backend, the release and the debug level, which every rank shares. Never complex: c10d's all-gather views it
    as real, the process group's own method refuses it."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "undefined":  # torch's default map
        backend = str(getattr(dist.Backend, "default_device_backend_map", {}).get(device.type, ""))
    elif ":" in backend:  # a device map: "cpu:gloo,cuda:nccl"
        backend = dict(pair.strip().partition(":")[::2] for pair in backend.split(",")).get(device.type, "")
    if dtype.is_complex or backend not in _COALESCING or backend == "gloo" and device.type != "cpu":
        return False
    return _COALESCES_UNDER_DETAIL or dist.get_debug_level() != dist.DebugLevel.DETAIL


def cuda_backend_of(spelling: str) -> str:
    """The backend serving CUDA tensors on a group whose ``dist.get_backend`` is ``spelling`` (``"nccl"``,
    ``"undefined"``: torch's default map, or a device map such as ``"cpu:gloo,cuda:nccl"``); ``""`` for none."""
    spelling = spelling.strip().lower()
    if ":" in spelling:
        for pair in spelling.split(","):
            device, _, backend = pair.partition(":")
            if device.strip() == "cuda":
                return backend.strip()
        return ""
    if spelling in ("", "undefined"):
        return str(getattr(dist.Backend, "default_device_backend_map", {}).get("cuda", "nccl"))
    return spelling


#: ``Partial`` reduce ops a writeback can represent locally (sums: the full tensor on coordinate 0, zeros
#: elsewhere; the others: the full tensor everywhere).
WRITABLE_PARTIAL_OPS = ("sum", "avg", "max", "min")


def partial_reduce_op(placement: Placement) -> str | None:
    """The reduce op of a ``Partial`` placement, lower case; None for any other placement."""
    if not placement.is_partial():
        return None
    return str(getattr(placement, "reduce_op", "sum")).lower().rsplit(".", 1)[-1]


def writeback_refusal(placements: Sequence[Placement]) -> str | None:
    """Why a writeback into a DTensor with these placements cannot be exact, or None."""
    for placement in placements:
        op = partial_reduce_op(placement)
        if op is not None and op not in WRITABLE_PARTIAL_OPS:
            return f"placement {placement} has a reduce op writeback cannot invert; use writeback=False"
    return None


def ungatherable_reason(placements: Sequence[Placement]) -> str | None:
    """Why this torch cannot gather a DTensor with these placements correctly, or None. From placements and
    the release only, so every rank answers alike, before any collective."""
    if STRIDED_SHARD_FULL_TENSOR_BROKEN and any(_is_standalone_strided(p, placements) for p in placements):
        return (
            f"placement {tuple(placements)} has a _StridedShard that no other mesh dim completes, which "
            f"torch {torch.__version__}'s DTensor.full_tensor() cannot gather (fixed in torch 2.12)"
        )
    return None


def _is_standalone_strided(placement: Placement, placements: Sequence[Placement]) -> bool:
    """A ``_StridedShard`` without a plain ``Shard`` of its tensor dim on another mesh dim (FSDP2 over tensor
    parallel's ``(_StridedShard(0, sf), Shard(0))`` gathers on every supported torch)."""
    if not is_strided_shard(placement):
        return False
    dim = placement.dim  # type: ignore[attr-defined]  # a _StridedShard (checked above), no Shard on torch >= 2.10
    return not any(type(other) is Shard and other.dim == dim for other in placements)


def cast_wrapper_master(local: torch.Tensor) -> torch.Tensor | None:
    """A cast wrapper's master, else None: a cast wrapper (torchao's float8 weights) flattens to one plain inner
    tensor of its own dtype, shape and device, plus scalars. From metadata only: every rank answers alike."""
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None:
        return None
    inner = [getattr(local, name, None) for name in flatten()[0]]
    masters = [t for t in inner if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter)
               and t.dtype == local.dtype and t.shape == local.shape and t.device == local.device]
    if len(masters) != 1 or any(t is not masters[0] and not (isinstance(t, torch.Tensor) and t.numel() <= 1)
                                for t in inner):
        return None
    return masters[0]


def gathered_local(local: torch.Tensor) -> torch.Tensor:
    """What a gather reads of a local shard: a cast wrapper's master where the subclass has FSDP2's all-gather
    extension (other such subclasses are refused first), else the shard itself."""
    master = cast_wrapper_master(local) if hasattr(local, "fsdp_pre_all_gather") else None
    return local if master is None else master
