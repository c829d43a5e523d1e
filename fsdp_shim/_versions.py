"""Supported dependency ranges, as data.

This module imports nothing heavier than the standard library, so that
``fsdp-shim check``, the import-time guard and packaging metadata can all read
the same facts without importing torch first.
"""

from __future__ import annotations

#: Requirement strings this package declares (mirrored in setup.cfg).
INSTRUMENTS: tuple[str, ...] = ("torch >= 2.6", "wrapt >= 2.5")

#: torch releases whose private FSDP2 internals ``_fsdp2_internals`` was read
#: against and whose test suite passed. Other releases >= 2.6 are allowed but
#: logged as untested.
TESTED_TORCH: tuple[str, ...] = ("2.13",)

#: The lowest wrapt release the patch lifecycle was tested with (it needs
#: ``unwrap_object``/``is_wrapped_by``, new in 2.5).
MIN_WRAPT = "2.5.0"

MIN_TORCH = "2.6"


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


def is_tested_torch(version: str) -> bool:
    return parse_version(version)[:2] in {parse_version(v)[:2] for v in TESTED_TORCH}
