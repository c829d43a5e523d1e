"""Supported dependency ranges, the version policy (``served``), and warnings once a group. Standard library
only at import: the CLI, the guard and the matrix read it without torch, and "torch cannot be imported" is said.
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
__version__ = "0.19.0"

#: The lowest torch release supported (inclusive) and the first one not yet verified (exclusive).
MIN_TORCH = "2.7"
NEXT_UNVERIFIED_TORCH = "2.16"
SUPPORTED_TORCH = f"torch >= {MIN_TORCH}, < {NEXT_UNVERIFIED_TORCH}"

#: Releases on which the whole suite and ``fsdp-shim check`` passed (``docs/versions.md``).
VERIFIED_TORCH: tuple[str, ...] = (
    "2.7.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0",
)

#: The patch lifecycle needs wrapt's ``unwrap_object``/``is_wrapped_by``, new in 2.5.
MIN_WRAPT = "2.5.0"

#: Requirement strings this package declares (``setup.cfg`` carries the lower bounds only).
INSTRUMENTS: tuple[str, ...] = (SUPPORTED_TORCH, f"wrapt >= {MIN_WRAPT}")

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
    """``(inactive, refusing)`` reasons, None where it serves; ``load_probe`` imports and returns the probe."""
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
    """None to serve this torch, else why DTensor summons are refused.

    [Note: version policy]
    A DTensor summon gathers correctly or raises, never FSDP1's silent no-op; so ``import fsdp_shim`` always
    patches (unless ``FSDP_SHIM_DISABLE``): *active* on ``SUPPORTED_TORCH``, or, with a warning, on a newer
    torch with every FSDP2 internal it reads (the probe); else *refusing*. ``FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH``
    serves anyway, warning (a wrong gather is worse than an error). A missing torch or an old wrapt: *inactive*.
    ``setup.cfg`` has lower bounds only: an upper one would make pip replace the user's torch.
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


# -- warnings once per process group, not once per rank (debug and info lines stay per rank) --

logger = logging.getLogger("fsdp_shim")


def is_leader(mesh: DeviceMesh | None = None) -> bool:
    """This process speaks for its group: lowest rank of ``mesh``, else global rank 0, else ``RANK`` 0 or unset."""
    try:
        import torch.distributed as dist  # noqa: PLC0415  (this module is torch-free at import)
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
