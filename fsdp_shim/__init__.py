"""fsdp_shim: FSDP1's ``summon_full_params`` for FSDP2, HSDP and tensor-parallel models.

Adoption is one line, at start-up; existing call sites then work on models sharded with ``fully_shard``::

    import fsdp_shim  # patches FullyShardedDataParallel.summon_full_params
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False, recurse=False):
        model.generate(...)                       # runs with full weights

New weight-sync code can stream instead (``iter_full_params``: the next unit in flight, cast before the
gather), or hand the stream to vLLM (``vllm_weight_source``). FSDP1 module trees still go to FSDP1's own
implementation. Supported: torch >= 2.7, < 2.16 and wrapt >= 2.5; on a torch it cannot serve, a DTensor
summon raises instead of doing nothing. The README is the user guide: examples, the exact semantics next to
FSDP1's, the version policy and the environment switches.
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

# No NullHandler: with logging unconfigured, Python's last-resort handler
# still shows our few warnings (an inactive or untested environment).
logger = logging.getLogger("fsdp_shim")

#: Why the shim does not serve DTensor summons here (``None`` when it does):
#: it is inactive, or patched in refusing mode (see [Note: version policy] in
#: ``_versions``). Reading it activates the shim (imports torch); see
#: [Note: deferred activation].
unsupported_reason: str | None

_UNITS_API = ("fsdp_units", "is_fsdp_module", "param_fqn")
_activation_lock = threading.RLock()
_activation = "pending"  # "pending" -> "running" -> "done"
_refusal: str | None = None  # set when the shim patches in refusing mode (see [Note: version policy])


def _load_probe() -> Callable[[], list[str]]:
    """The FSDP2 boundary imported, and its probe: ``_versions.verdict`` calls it (the internals may have moved)."""
    from fsdp_shim import _fsdp2  # noqa: PLC0415  (the probe: the FSDP2 internals may have moved)

    return _fsdp2.missing_internals


def _activate() -> str | None:
    """Check the environment once, patch unless disabled; returns ``unsupported_reason``.

    Re-entrant: checking imports ``torch.distributed.fsdp``, whose post-import
    hook calls back here and returns at once; the outer call finishes the work.

    [Note: deferred activation]
    ``import fsdp_shim`` imports neither torch nor anything that does: it
    registers a wrapt post-import hook on ``torch.distributed.fsdp``, which fires
    at once if FSDP is already imported and otherwise the moment it is, before
    any caller can reach ``FullyShardedDataParallel``. The hook *activates* the
    shim: checks the environment (``unsupported_reason``), then patches unless
    ``FSDP_SHIM_DISABLE`` is set. Any public call that needs torch activates
    first, so nothing observable depends on the order of the imports, and
    ``fsdp-shim --help`` answers without loading torch.

    A submodule imported first (``import fsdp_shim._summon``) imports FSDP part
    way through its own import, so the hook fires while the package is half
    built, and patching would import that very module. The hook then waits:
    each submodule has a post-import hook of its own (wrapt again), and the
    first one to fire with no other submodule still being imported activates.
    """
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
    """``_patching.patch``, handed the DTensor summon's wrapper unless refusing: the one place above both that
    knows of both (``_patching`` never imports the summon; see [Note: refusing mode] there)."""
    from fsdp_shim import _patching  # noqa: PLC0415  (torch is imported by now, not at ours)

    if refusal is not None:
        return _patching.patch(refusal)
    from fsdp_shim._summon import summon_full_params_wrapper  # noqa: PLC0415  (needs the FSDP2 internals)

    return _patching.patch(summon=summon_full_params_wrapper)


def _submodule_importing(besides: str = "") -> bool:
    """Whether a submodule other than ``besides`` is part way through its import. See [Note: deferred activation]."""
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
    """Activate, if the FSDP hook waited for this import chain to finish (see [Note: deferred activation])."""
    if _activation == "pending" and "torch.distributed.fsdp" in sys.modules \
            and not _submodule_importing(besides=module.__name__):
        _activate()


def _submodule_names() -> list[str]:
    """Every submodule's dotted name, subpackages' too, found on disk: nothing is imported to list them."""
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
    """Make ``FullyShardedDataParallel.summon_full_params`` serve DTensor models too.

    Idempotent: returns True if it installed the wrapper, False if ours was
    already installed (it never stacks a second one; the import installs it)
    or if ``FSDP_SHIM_DISABLE`` is set (1, true, yes or on, any case). On a
    torch it cannot serve (``unsupported_reason`` says why) the wrapper
    refuses DTensor summons with a ``RuntimeError`` instead of FSDP1's
    silent no-op.
    """
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
    """The original (sharded) parameter behind a full parameter of a live context, else ``None``.

    Inside ``summon_full_params`` each slot holds a new full ``nn.Parameter``;
    FSDP2 and your optimizer keep the sharded one, which comes back on exit.
    Use this to key a map built before the context::

        names = {p: n for n, p in model.named_parameters()}   # before
        with FSDP.summon_full_params(model, writeback=False):
            for p in model.parameters():
                name = names[fsdp_shim.sharded_param(p)]
    """
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
    """Gather full parameters for ``module``, with FSDP1's signature and semantics.

    Usable without patching. FSDP1 trees go to FSDP1; DTensor parameters in
    scope are gathered and swapped in; anything else is a null context.

    Args:
        recurse: include nested FSDP units; ``False`` keeps to the module's own unit.
        writeback: on exit, copy each rank's slice of the (edited) full
            parameters (and gradients, with ``with_grads``) into its shard in place.
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
    """Stream ``(name, full tensor)`` for every parameter of a DTensor model, unit by unit.

    For new weight-sync code (an inference engine fed from an FSDP2, HSDP or
    tensor-parallel model), in place of a ``summon_full_params`` per unit::

        for name, tensor in fsdp_shim.iter_full_params(model, dtype=torch.bfloat16):
            if tensor is not None:          # rank 0
                engine.load_weight(name, tensor)

    A collective: every rank iterates, in step, to the end (or all stop early
    alike). Every rank sees the same names, in the same order: FSDP2 unit by
    unit, each unit's parameters in ``named_parameters()`` order, a tied
    parameter once under its first name. Nothing in the model changes.

    Args:
        dtype: floating parameters travel in this dtype: each rank casts its
            shard *before* the gather (bf16 moves half of fp32's bytes).
            Values equal ``full.to(dtype)``. ``None``: the stored dtype (the
            fp32 master weights under a bf16 ``MixedPrecisionPolicy``), exact.
        keep_dtype: parameters exempt from ``dtype``: they travel in their
            stored dtype, exact (an MoE router's gate kept fp32 while the rest
            go bf16). A glob pattern or a sequence of them (``fnmatch``,
            case-sensitive, matched against the dotted name, e.g.
            ``"*.router.weight"``), or a predicate ``name -> bool``. A tied
            parameter is kept if any of its names matches; it is still
            yielded once, under its first name. Patterns that match nothing
            log a warning (a typo, or a model without such parameters).
        rank0_only: only global rank 0 receives tensors; the others get
            ``None`` for each name (and still send their shards).
        device: where the full tensors land, as torch names devices: ``"cpu"``
            for host memory (pageable, as FSDP1's offload), ``"cuda"`` for the
            current GPU; default where the gather runs.
        bucket_mb: cap on one gather bucket, in MiB (default: ``$FSDP_SHIM_BUCKET_MB`` or 6).

    The generator drops each tensor at the next step of the iteration, and
    the next unit's gather is already in flight while you use the current
    one. Keep no references and the extra memory stays near the two largest
    units plus padding, whatever the model's size. Every tensor is fresh
    memory nothing else writes, so keeping one (or its storage, a numpy
    view, a shared-memory copy) costs memory, never its values. Before the
    first unit moves it refuses what ``summon_full_params`` refuses, in the
    same words; stopped early or failed, it waits for every gather it
    posted. Treat tensors as read-only.

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
    """``iter_full_params`` as vLLM's own ``WeightSource``, for its native weight-transfer engines.

    ::

        source = fsdp_shim.vllm_weight_source(model, torch.bfloat16)   # on every trainer rank
        engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
        engine.send_weights()                                            # each round, every rank

    Returns an instance of a subclass of ``vllm.distributed.weight_transfer.base.WeightSource``
    (vLLM is imported by this call, not by ``import fsdp_shim``):

    * ``metadata``: ``ParamMeta(name, wire dtype, full shape)`` for every parameter once (a tie
      under its first name), in exactly ``iter_full()``'s order (FSDP2 unit by unit, the root's
      unit first: not ``named_parameters()`` order), the dtype after the cast (``keep_dtype``
      respected); a ``functools.cached_property``, identical on every rank, computed from the
      module tree, FSDP2's state and DTensor metadata: no collective, no full tensor. Read it
      once the model is sharded.
    * ``iter_full()``: a fresh pass of ``iter_full_params`` each call (cast before the gather, the
      next unit in flight, memory near two units): a collective, so every trainer rank iterates
      it to the end, in step.

    Names are the model's parameter names without the wrapper segments
    ``_checkpoint_wrapped_module.`` (activation checkpointing) and ``_orig_mod.``
    (``torch.compile``), then ``name_map`` (FSDP1's ``_fsdp_wrapped_module.`` cannot occur:
    FSDP1 trees are refused, as by the stream). Ownership is unset (``owners=None``): every rank
    drives every gather.

    Args:
        dtype: the wire dtype of floating parameters, cast before the gather (``None``: stored dtype).
        keep_dtype: parameters that travel uncast, as in ``iter_full_params``; patterns match the
            model's name or the name without wrapper segments (before ``name_map``).
        receivers: ``"sender"``: only global rank 0 gets tensors, the others yield ``(name, None)``
            and only join the gathers (vLLM's NCCL broadcast engine; its non-sender ranks drive
            ``iter_full()`` and ignore what it yields). ``"all"``: every rank gets every tensor
            (the colocated IPC engine, one vLLM worker per trainer GPU). vLLM's trainer rank 0
            must be global rank 0.
        name_map: ``str -> str`` applied to every name after the wrapper segments are removed
            (the inference model's naming); two parameters mapped alike raise ``ValueError``.
        device, bucket_mb: as in ``iter_full_params``.

    Raises:
        ImportError: vLLM cannot be imported, or lacks this ``WeightSource`` interface (vLLM
            0.33.0 has it; 0.28 to 0.32 have an earlier one).
        TypeError, ValueError: what ``iter_full_params`` refuses, in its words; ``receivers``
            other than ``"sender"`` or ``"all"``; a ``name_map`` that is not callable.
    """
    _require_support()
    from fsdp_shim._vllm import make_source  # noqa: PLC0415  (after activation; vLLM on first use)

    return make_source(model, dtype, keep_dtype=keep_dtype, receivers=receivers, name_map=name_map, device=device,
                       bucket_mb=bucket_mb)
