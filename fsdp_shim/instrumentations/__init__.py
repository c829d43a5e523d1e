"""The instrumentations ``patch()`` installs (OpenTelemetry's manner: one module a client library, plus
``forward_io``'s mends of FSDP2's forward walks). Only ``_patching`` imports this package."""

from __future__ import annotations

from fsdp_shim.instrumentations.base import Instrumentation
from fsdp_shim.instrumentations.compose_rl import ComposeRLPadTokenFlip, ComposeRLWeightSync
from fsdp_shim.instrumentations.composer import ComposerFSDPGate
from fsdp_shim.instrumentations.forward_io import FSDP2ForwardCast, ModelOutputFlatten

INSTRUMENTATIONS: tuple[Instrumentation, ...] = (
    ComposeRLWeightSync(), ComposerFSDPGate(), ComposeRLPadTokenFlip(), ModelOutputFlatten(), FSDP2ForwardCast(),
)


def instrument_all() -> None:
    for instrumentation in INSTRUMENTATIONS:
        instrumentation.instrument()


def uninstrument_all() -> None:
    for instrumentation in INSTRUMENTATIONS:
        instrumentation.uninstrument()


def statuses() -> dict[str, str]:
    """``{module: status}`` for ``fsdp-shim check --verbose``."""
    return {i.module: i.status for i in INSTRUMENTATIONS}
