"""DTensor and c10d differences between torch releases, named by behaviour.

Everything here was read from each release's wheel and is exercised by the version matrix
(``scripts/matrix.py``; the runs are in ``docs/versions.md``). FSDP2's own differences live in ``_fsdp2``, next door.

[Note: torch versions]
| behaviour                                                                                               | releases   |
|---------------------------------------------------------------------------------------------------------|------------|
| placements are Python classes; ``_StridedShard`` subclasses ``Shard``, so ``is_shard(0)`` is True       | <= 2.9     |
| placements are C++ objects; ``_StridedShard`` is not a ``Shard``                                        | >= 2.10    |
| ``full_tensor()`` fails for a standalone ``_StridedShard`` (no plain ``Shard`` of its dim completes it) | 2.10, 2.11 |
The fast path therefore tests placement *types* exactly (``type(p) is Shard``), never ``is_shard()``: a
placement it does not know, today's or a future subclass, always takes the ``full_tensor()`` fallback.
A local shard that is a cast wrapper (torchao's float8 weights) is read as its master (``gathered_local``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_shim._versions import parse_version

try:  # private, but the only way to name it; present on every release we support
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - a future torch without it
    _StridedShard = None  # type: ignore[assignment,misc]  # a class where torch has one

_TORCH = parse_version(torch.__version__)

def is_dim0_shard(placement: Placement) -> bool:
    """Exactly ``Shard(0)``: no subclass (``_StridedShard`` is one on torch <= 2.9)."""
    return type(placement) is Shard and placement.dim == 0


def is_replicate(placement: Placement) -> bool:
    return type(placement) is Replicate


def is_strided_shard(placement: Placement) -> bool:
    return _StridedShard is not None and isinstance(placement, _StridedShard)


#: Releases whose ``DTensor.full_tensor()`` rejects a ``_StridedShard`` that
#: no later mesh dim completes (torch's own redistribute bug, fixed in 2.12).
STRIDED_SHARD_FULL_TENSOR_BROKEN = (2, 10) <= _TORCH[:2] < (2, 12)


def cuda_backend_of(spelling: str) -> str:
    """The backend serving CUDA tensors on a group whose ``dist.get_backend`` is ``spelling``; ``""`` for none.

    [Note: NCCL as torch resolves it]
    A group's backend string is what it was created with: ``"nccl"``;
    ``"undefined"`` for ``init_process_group()`` with no backend, where
    torch's default map (``Backend.default_device_backend_map``) gives CUDA
    tensors to NCCL; or a device map, ``"cuda:nccl,cpu:gloo"`` (torchtune) or
    ``"cpu:gloo,cuda:nccl"`` (verl), either order. Comparing the string with
    ``"nccl"`` misses all but the first. A pure function of the string, so
    every spelling is testable without a GPU; ``_health.serves_cuda_with_nccl``
    asks a live group first.
    """
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


#: ``Partial`` reduce ops whose full value a writeback can represent locally: the
#: full tensor on mesh coordinate 0 and zeros elsewhere for sums, the full
#: tensor everywhere for the others.
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
    """Why this torch cannot gather a DTensor with these placements correctly, or None.

    Depends on placements and the torch release only, so every rank answers
    alike and a refusal comes before any collective.
    """
    if STRIDED_SHARD_FULL_TENSOR_BROKEN and any(_is_standalone_strided(p, placements) for p in placements):
        return (
            f"placement {tuple(placements)} has a _StridedShard that no other mesh dim completes, which "
            f"torch {torch.__version__}'s DTensor.full_tensor() cannot gather (fixed in torch 2.12)"
        )
    return None


def _is_standalone_strided(placement: Placement, placements: Sequence[Placement]) -> bool:
    """A ``_StridedShard`` without a plain ``Shard`` of the same tensor dim on another mesh dim.

    FSDP2 over tensor parallel produces ``(_StridedShard(0, sf), Shard(0))``,
    which every supported torch gathers; only the standalone form fails.
    """
    if not is_strided_shard(placement):
        return False
    dim = placement.dim  # type: ignore[attr-defined]  # a _StridedShard (checked above), no Shard on torch >= 2.10
    return not any(type(other) is Shard and other.dim == dim for other in placements)


def cast_wrapper_master(local: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor whose values a cast wrapper's are, or None for any other tensor subclass.

    A cast wrapper's ``__tensor_flatten__`` names exactly one plain inner tensor of its own dtype, shape and
    device (its master), and any other inner tensor holds one element at most (a cast's scale): torchao's
    float8 ``WeightWithDynamicFloat8CastTensor`` and its fp32 master. NF4's quantized inner tensors have
    other shapes and dtypes. Reads types and metadata only (torchao's ``__tensor_flatten__`` tests whether a
    scale is set, which changes only which scalars it names), so every rank answers alike (see
    [Note: all-gather extensions] in ``_refusals``).
    """
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
    """What a gather reads of a local shard that is a tensor subclass: a cast wrapper's master where the
    subclass has FSDP2's all-gather extension (the others are refused first), else the shard itself."""
    master = cast_wrapper_master(local) if hasattr(local, "fsdp_pre_all_gather") else None
    return local if master is None else master
