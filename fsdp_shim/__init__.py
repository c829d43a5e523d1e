"""fsdp_shim: FSDP1's ``summon_full_params`` for FSDP2, HSDP and tensor-parallel models.

``import fsdp_shim`` patches ``FullyShardedDataParallel.summon_full_params`` (FSDP1 trees still go to FSDP1).
Weight sync can stream instead (``iter_full_params``, ``vllm_weight_source``). The README is the user guide.
"""

from __future__ import annotations

import logging
import pkgutil
import sys
import threading
from typing import TYPE_CHECKING, Any, ContextManager

import wrapt

from fsdp_shim import _versions
from fsdp_shim._errors import DestroyedGroupError, GroupOutOfStepError, UnsupportedTorchError, WritebackRefusedError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    import torch
    import torch.nn as nn

    from fsdp_shim._common import fsdp_units, is_fsdp_module, param_fqn


__version__ = _versions.__version__

__all__ = [
    "DestroyedGroupError",
    "GroupOutOfStepError",
    "UnsupportedTorchError",
    "WritebackRefusedError",
    "is_fsdp_module",
    "fsdp_units",
    "is_patched",
    "iter_full_params",
    "param_fqn",
    "patch",
    "sharded_param",
    "summon_full_params",
    "unpatch",
    "vllm_weight_source",
    "__version__",
]

# No NullHandler: unconfigured, Python's last-resort handler still shows our few warnings.
logger = logging.getLogger("fsdp_shim")

#: Why the shim does not serve DTensor summons here (``None`` when it does); reading it activates the shim.
unsupported_reason: str | None

_UNITS_API = ("fsdp_units", "is_fsdp_module", "param_fqn")
_activation_lock = threading.RLock()
_activation = "pending"  # "pending" -> "running" -> "done"
_refusal: str | None = None  # set when the shim patches in refusing mode


def _load_probe() -> Callable[[], list[str]]:
    """The FSDP2 boundary imported, and its probe (``_versions.verdict`` calls it)."""
    from fsdp_shim import _fsdp2  # noqa: PLC0415  (the probe: the FSDP2 internals may have moved)

    return _fsdp2.missing_internals


def _activate() -> str | None:
    """Check the environment once, patch unless disabled; returns ``unsupported_reason``. Run by a post-import
    hook on ``torch.distributed.fsdp`` (``import fsdp_shim`` imports no torch) and by every public call, so
    import order does not matter; a submodule importing FSDP half way defers it to ``_on_submodule_imported``.
    Re-entrant: the check imports FSDP, whose hook returns at once."""
    global _activation, unsupported_reason, _refusal
    with _activation_lock:
        if _activation == "done":
            return unsupported_reason
        if _activation == "running":
            return None
        _activation = "running"
        try:
            inactive, refusal = _versions.verdict(_load_probe)
        finally:
            _activation = "pending"
        unsupported_reason, _refusal = inactive or refusal, refusal
        _activation = "done"
        if inactive is not None:
            _versions.log_warning("fsdp_shim is inactive: %s", inactive)
        elif not _versions.env_flag(_versions.DISABLE_ENV):
            if refusal is not None:
                _versions.log_warning(
                    "fsdp_shim refuses DTensor summons here (FSDP1 and plain modules are unaffected): %s", refusal)
            _install(refusal)
        return unsupported_reason


def _install(refusal: str | None) -> bool:
    """``_patching.patch``, handed the summon's wrapper unless refusing."""
    from fsdp_shim import _patching  # noqa: PLC0415  (torch is imported by now, not at ours)

    if refusal is not None:
        return _patching.patch(refusal)
    from fsdp_shim._summon import summon_full_params_wrapper  # noqa: PLC0415  (needs the FSDP2 internals)

    return _patching.patch(summon=summon_full_params_wrapper)


def _submodule_importing(besides: str = "") -> bool:
    """Whether a submodule other than ``besides`` is part way through its import (see ``_activate``)."""
    prefix = f"{__name__}."
    return any(
        name.startswith(prefix) and name != besides and getattr(getattr(m, "__spec__", None), "_initializing", False)
        for name, m in list(sys.modules.items())
    )


@wrapt.when_imported("torch.distributed.fsdp")
def _on_fsdp_imported(_module: Any) -> None:
    if not _submodule_importing():
        _activate()


def _on_submodule_imported(module: Any) -> None:
    """Activate, if the FSDP hook waited for this import chain to finish (see ``_activate``)."""
    if _activation == "pending" and "torch.distributed.fsdp" in sys.modules \
            and not _submodule_importing(besides=module.__name__):
        _activate()


def _submodule_names() -> list[str]:
    """Every submodule's dotted name, subpackages' too, listed without importing them."""
    names = []
    for found in pkgutil.iter_modules(__path__):
        if found.name == "__main__":
            continue
        names.append(f"{__name__}.{found.name}")
        if found.ispkg:
            names += [f"{__name__}.{found.name}.{sub.name}"
                      for sub in pkgutil.iter_modules([f"{__path__[0]}/{found.name}"])]
    return names


for _submodule in _submodule_names():
    wrapt.when_imported(_submodule)(_on_submodule_imported)


def __getattr__(name: str) -> Any:
    """Names that need torch, served on first use (PEP 562)."""
    if name == "unsupported_reason":
        return _activate()
    if name in _UNITS_API:
        from fsdp_shim import _common  # noqa: PLC0415  (needs torch: on first use, PEP 562)

        return getattr(_common, name)
    raise AttributeError(f"module 'fsdp_shim' has no attribute {name!r}")


def _require_support() -> None:
    reason = _activate()
    if _refusal is not None:
        raise UnsupportedTorchError(f"fsdp_shim refuses to gather DTensor parameters here: {_refusal}")
    if reason is not None:
        raise UnsupportedTorchError(f"fsdp_shim is inactive: {reason}")


def patch() -> bool:
    """Make ``FullyShardedDataParallel.summon_full_params`` serve DTensor models too; False if already installed
    (the import installs it) or ``FSDP_SHIM_DISABLE`` is set. Where ``unsupported_reason`` is set, DTensor
    summons raise ``UnsupportedTorchError``."""
    reason = _activate()
    if reason is not None and _refusal is None:
        raise UnsupportedTorchError(f"fsdp_shim is inactive: {reason}")
    if _versions.env_flag(_versions.DISABLE_ENV):
        logger.info("fsdp_shim: %s is set, not patching", _versions.DISABLE_ENV)
        return False
    return _install(_refusal)


def unpatch() -> bool:
    """Restore the exact original ``summon_full_params``; returns False if there was nothing to undo."""
    if _activate() is not None and _refusal is None:
        return False
    from fsdp_shim import _patching  # noqa: PLC0415  (needs torch: after activation)

    return _patching.unpatch()


def is_patched() -> bool:
    """Whether our wrapper is currently installed on ``FullyShardedDataParallel`` (refusing or not)."""
    if _activate() is not None and _refusal is None:
        return False
    from fsdp_shim import _patching  # noqa: PLC0415  (needs torch: after activation)

    return _patching.is_patched()


def sharded_param(param: torch.Tensor) -> nn.Parameter | None:
    """The original (sharded) parameter behind a full parameter of a live context, else ``None``: inside, each
    slot holds a new ``nn.Parameter``, so a map built before the context is keyed through this."""
    if _activate() is not None:
        return None
    from fsdp_shim._param import sharded_param as _sharded_param  # noqa: PLC0415  (after activation)

    return _sharded_param(param)


def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
    *,
    bucket_mb: float | None = None,
) -> ContextManager[Any]:
    """Gather full parameters for ``module``, with FSDP1's signature and semantics; usable without patching.
    FSDP1 trees go to FSDP1, DTensor parameters are gathered and swapped in, anything else is a null context.

    Args:
        recurse: include nested FSDP units; ``False`` keeps to the module's own unit.
        writeback: on exit, copy each rank's slice of the full parameters (and gradients) into its shard.
        rank0_only: only global rank 0 gets full parameters.
        offload_to_cpu: the full parameters live on CPU.
        with_grads: full parameters carry full gradients (``None`` stays ``None``).
        bucket_mb: cap on one gather bucket, in MiB (default: ``$FSDP_SHIM_BUCKET_MB`` or 4).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        NotImplementedError: ``writeback`` with ``rank0_only``, or ``with_grads`` with ``offload_to_cpu``.
        AssertionError: called during FSDP2 forward or backward (FSDP1 raises the same).
    """
    _require_support()
    from fsdp_shim._summon import summon  # noqa: PLC0415  (after activation)

    return summon(
        module, recurse, writeback, rank0_only, offload_to_cpu, with_grads, bucket_mb=bucket_mb
    )



def iter_full_params(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    keep_dtype: str | Sequence[str] | Callable[[str], bool] | None = None,
    rank0_only: bool = True,
    device: torch.device | str | None = None,
    bucket_mb: float | None = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Stream ``(name, full tensor)`` for every parameter of a DTensor model, FSDP2 unit by unit, the next unit
    in flight; each tensor is fresh memory (keep none, and extra memory stays near the two largest units).

    A collective: every rank iterates to the end, in step, with the same names (a tie once, under its first).
    Left early (``break``, an exception) after the first gather, the stream waits for what it posted and its
    groups are out of step (later calls raise ``GroupOutOfStepError``). Refuses what ``summon_full_params``
    refuses, before the first gather; changes nothing in the model.

    Args:
        dtype: floating parameters travel in this dtype, each shard cast *before* the gather (values
            equal ``full.to(dtype)``). ``None``: the stored dtype, exact.
        keep_dtype: parameters exempt from ``dtype``: a glob pattern (``"*.router.weight"``) or a sequence of
            them, or a predicate ``name -> bool``; a tie is kept if any name matches; matching nothing warns.
        rank0_only: only global rank 0 receives tensors; the others get ``None`` for each name.
        device: where the full tensors land (``"cpu"``, ``"cuda"``); default where the gather runs.
        bucket_mb: cap on one gather bucket, in MiB (default: ``$FSDP_SHIM_BUCKET_MB`` or 6).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, holds FSDP1 units, ``dtype`` is not floating,
            or ``keep_dtype`` is neither patterns nor a predicate.
        ValueError: ``bucket_mb`` is not positive.
        NotImplementedError: a parameter's placements cannot be gathered on this torch.
    """
    _require_support()
    from fsdp_shim._stream import check_stream_args, stream_full_params  # noqa: PLC0415  (after activation)

    check_stream_args(model, dtype, bucket_mb, keep_dtype, device)
    return stream_full_params(
        model, dtype=dtype, rank0_only=rank0_only, device=device, bucket_mb=bucket_mb, keep_dtype=keep_dtype,
    )


def vllm_weight_source(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    *,
    keep_dtype: str | Sequence[str] | Callable[[str], bool] | None = None,
    receivers: str = "sender",
    name_map: Callable[[str], str] | None = None,
    device: torch.device | str | None = None,
    bucket_mb: float | None = None,
) -> Any:
    """``iter_full_params`` as a subclass of vLLM's own ``WeightSource`` (vLLM imported by this call), for its
    weight-transfer engines: ``trainer_init(..., source=source)`` on every trainer rank. ``metadata``: each
    parameter's name, wire dtype and full shape, in ``iter_full()``'s order, no collective; ``iter_full()``: a
    fresh pass, a collective. Names lose ``_checkpoint_wrapped_module.`` and ``_orig_mod.``, then ``name_map``.

    Args:
        dtype: the wire dtype of floating parameters, cast before the gather (``None``: stored dtype).
        keep_dtype: parameters that travel uncast, as in ``iter_full_params``; patterns match the
            model's name or the name without wrapper segments (before ``name_map``).
        receivers: ``"sender"``: only global rank 0 gets tensors, the others yield ``(name, None)`` (the
            NCCL broadcast engine; its trainer rank 0 must be global rank 0). ``"all"``: every rank gets
            every tensor (the colocated IPC engine).
        name_map: ``str -> str`` applied to every name after the wrapper segments are removed; two
            parameters mapped alike raise ``ValueError``.
        device, bucket_mb: as in ``iter_full_params``.

    Raises:
        ImportError: vLLM cannot be imported, or lacks this ``WeightSource`` (0.33.0 has it).
        TypeError, ValueError: what ``iter_full_params`` refuses; a bad ``receivers`` or ``name_map``.
    """
    _require_support()
    from fsdp_shim._vllm import make_source  # noqa: PLC0415  (after activation; vLLM on first use)

    return make_source(model, dtype, keep_dtype=keep_dtype, receivers=receivers, name_map=name_map, device=device,
                       bucket_mb=bucket_mb)
