"""Supported dependency ranges and the version policy, as data.

This module imports nothing heavier than the standard library, so that
``fsdp-shim check``, the import-time guard, the version matrix and the tests
can all read the same facts without importing torch first.

[Note: version policy]
- torch inside ``SUPPORTED_TORCH`` (every release in ``VERIFIED_TORCH`` passed
  the whole suite and ``fsdp-shim check``): ``import fsdp_shim`` patches.
- torch outside it: the import patches nothing and logs a warning that says
  why, because the FSDP2 internals the shim relies on change between
  releases (see ``_fsdp2_internals``) and a wrong gather is worse than none.
  ``FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH=1`` patches anyway, with a warning.
- ``setup.cfg`` declares the lower bound only: an upper bound there would make
  pip replace a training environment's torch, a multi-GB change nobody asked
  for. The upper bound is enforced here, at import.
"""

from __future__ import annotations

import os

#: This package's version (setup.cfg reads it from here, without importing torch).
__version__ = "0.4.3"

#: The lowest torch release supported (inclusive) and the first one not yet
#: verified (exclusive).
MIN_TORCH = "2.7"
NEXT_UNVERIFIED_TORCH = "2.15"
SUPPORTED_TORCH = f"torch >= {MIN_TORCH}, < {NEXT_UNVERIFIED_TORCH}"

#: Releases on which the whole suite and ``fsdp-shim check`` passed
#: (``scripts/matrix.py``; the README's "Supported versions" table).
VERIFIED_TORCH: tuple[str, ...] = (
    "2.7.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1",
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


def is_verified_torch(version: str) -> bool:
    """One of the exact releases the matrix passed on (local labels such as ``+cpu`` ignored)."""
    return parse_version(version)[:3] in {parse_version(v) for v in VERIFIED_TORCH}
