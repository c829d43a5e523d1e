"""Supported dependency ranges, the version policy, and how the package warns: once a group.

This module imports nothing heavier than the standard library, so that
``fsdp-shim check``, the import-time guard, the version matrix and the tests
can all read the same facts without importing torch first, and so that the
warning that torch cannot be imported can still be given. ``verdict`` (with
``served``) is the one owner of whether a torch is served: [Note: version
policy] is beside ``served``.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: This package's version (setup.cfg reads it from here, without importing torch).
__version__ = "0.17.0"

#: The lowest torch release supported (inclusive) and the first one not yet
#: verified (exclusive).
MIN_TORCH = "2.7"
NEXT_UNVERIFIED_TORCH = "2.16"
SUPPORTED_TORCH = f"torch >= {MIN_TORCH}, < {NEXT_UNVERIFIED_TORCH}"

#: Releases on which the whole suite and ``fsdp-shim check`` passed
#: (``scripts/matrix.py``; the table in ``docs/versions.md``).
VERIFIED_TORCH: tuple[str, ...] = (
    "2.7.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0",
)

#: The lowest wrapt release the patch lifecycle was tested with (it needs
#: ``unwrap_object``/``is_wrapped_by``, new in 2.5).
MIN_WRAPT = "2.5.0"

#: Requirement strings this package declares (``setup.cfg`` carries the
#: lower bounds; see [Note: version policy]).
INSTRUMENTS: tuple[str, ...] = (SUPPORTED_TORCH, f"wrapt >= {MIN_WRAPT}")

#: Environment switches.
DISABLE_ENV = "FSDP_SHIM_DISABLE"
ALLOW_UNSUPPORTED_TORCH_ENV = "FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH"

_TRUTHY = {"1", "true", "yes", "on"}


def env_flag(name: str) -> bool:
    """A boolean environment switch: ``1``, ``true``, ``yes`` or ``on``, in any case."""
    return os.environ.get(name, "").strip().lower() in _TRUTHY


def parse_version(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; stops at the first non-numeric part."""
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def at_least(version: str, minimum: str) -> bool:
    return parse_version(version) >= parse_version(minimum)


def is_supported_torch(version: str) -> bool:
    """Inside ``SUPPORTED_TORCH``, by release (pre-releases of a supported release count)."""
    release = parse_version(version)[:3]
    return parse_version(MIN_TORCH) <= release < parse_version(NEXT_UNVERIFIED_TORCH)


def is_newer_than_supported(version: str) -> bool:
    """At or past ``NEXT_UNVERIFIED_TORCH``: a release the matrix has not seen yet."""
    return parse_version(version)[:3] >= parse_version(NEXT_UNVERIFIED_TORCH)


def is_verified_torch(version: str) -> bool:
    """One of the exact releases the matrix passed on (local labels such as ``+cpu`` ignored)."""
    return parse_version(version)[:3] in {parse_version(v) for v in VERIFIED_TORCH}


def verdict(load_probe: Callable[[], Callable[[], list[str]]]) -> tuple[str | None, str | None]:
    """``(inactive, refusing)``: why the shim cannot patch here, or why it patches refusing; None each
    where it serves. The one owner of "which torch is served" (see [Note: version policy] at ``served``):
    a torch that cannot be imported, or a wrapt below ``MIN_WRAPT``, leaves it inactive; FSDP2 internals
    that fail to import (``load_probe`` imports them and returns the probe) or ``served``'s answer make
    it refuse. Imports torch and wrapt here, on the call, never at this module's import."""
    try:
        import torch  # noqa: PLC0415  (the probe: torch may be missing)
    except ImportError as exc:
        return f"torch cannot be imported ({exc})", None
    import wrapt  # noqa: PLC0415  (on the call, as torch)

    wrapt_version = getattr(wrapt, "__version__", "0")
    if not at_least(wrapt_version, MIN_WRAPT):
        return f"wrapt {wrapt_version} lacks unwrap_object (needs >= {MIN_WRAPT})", None
    try:
        missing_internals = load_probe()
    except ImportError as exc:  # the FSDP2 internals we rely on moved
        return None, f"torch {torch.__version__} lacks the FSDP2 internals fsdp_shim uses ({exc})"
    return None, served(torch.__version__, missing_internals)


def served(torch_version: str, missing_internals: Callable[[], list[str]]) -> str | None:
    """Whether this torch is served: None to serve it, else why the shim refuses DTensor summons
    (refusing mode). The one owner of that decision; see [Note: version policy], below.

    A supported release is served. A newer one is served, with a warning, when every FSDP2
    internal the shim reads is present (``missing_internals()``, the probe, asked only then);
    anything else is refused, unless ``$FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH`` is set, which serves
    it with a warning.

    [Note: version policy]
    A call site must never be FSDP1's silent no-op on a DTensor model: a summon
    either gathers correctly or raises. So ``import fsdp_shim`` always patches
    (unless ``FSDP_SHIM_DISABLE`` is set), in one of two modes:
    - *active*: torch inside ``SUPPORTED_TORCH`` (every release in
      ``VERIFIED_TORCH`` passed the whole suite and ``fsdp-shim check``); or a
      newer, unverified torch on which every FSDP2 and c10d internal the shim
      reads is present (``_fsdp2.missing_internals``, probed once at
      activation, listed by ``fsdp-shim check -v``), with a warning once.
    - *refusing*: any other torch (older than ``MIN_TORCH``, or newer with an
      internal missing). FSDP1 trees still go to FSDP1 and plain modules get
      FSDP1's null context, but a summon of a module holding DTensors raises a
      ``RuntimeError`` naming the torch release, what is missing and the
      override. ``FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH=1`` makes it active anyway,
      with a warning: a wrong gather is worse than an error, so that is the
      user's explicit choice.
    Only a missing torch or a wrapt without ``unwrap_object`` leaves the shim
    unpatched (*inactive*), with a warning. ``setup.cfg`` declares the lower
    bounds only: an upper bound there would make pip replace a training
    environment's torch, a multi-GB change nobody asked for.
    """
    if is_supported_torch(torch_version):
        return None
    if is_newer_than_supported(torch_version):
        missing = missing_internals()
        if not missing:
            log_warning(
                "fsdp_shim: torch %s is newer than the verified %s; every FSDP2 internal fsdp_shim reads is "
                "present, so it is active. Run `fsdp-shim check` to verify this release.",
                torch_version, SUPPORTED_TORCH,
            )
            return None
        problem = f"torch {torch_version} lacks FSDP2 internals fsdp_shim reads: {', '.join(missing)}"
    else:
        problem = f"torch {torch_version} is outside the supported {SUPPORTED_TORCH}"
    if not env_flag(ALLOW_UNSUPPORTED_TORCH_ENV):
        return f"{problem} (set {ALLOW_UNSUPPORTED_TORCH_ENV}=1 to gather anyway, at your own risk)"
    log_warning("fsdp_shim: gathering although %s, because %s is set", problem, ALLOW_UNSUPPORTED_TORCH_ENV)
    return None


# -- warnings once per process group, not once per rank ---------------------
# A job of N ranks runs the same code N times; a warning every rank repeats says
# nothing new. The *leader* speaks for its group: the lowest global rank of the
# mesh a warning is about, else global rank 0, else (no process group yet, as
# at import under torchrun) the process whose ``RANK`` is 0 or unset. Debug and
# info lines stay per rank: they describe what that rank did.

logger = logging.getLogger("fsdp_shim")


def is_leader(mesh: DeviceMesh | None = None) -> bool:
    """Whether this process speaks for its group: its *leader* (see the comment above)."""
    try:
        import torch.distributed as dist  # noqa: PLC0415  (this module is torch-free: see its docstring)
    except ImportError:
        dist = None  # type: ignore[assignment]  # no torch: warnings still work
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
