"""The instrumentations ``patch()`` installs: one module a client library, in OpenTelemetry's manner.

Client instrumentations adapt FSDP1-era call sites that never reach
``FullyShardedDataParallel.summon_full_params`` on FSDP2 (``composer``,
``compose_rl``); the forward-I/O ones (``forward_io``) mend how FSDP2 walks
forward inputs and outputs. The mechanism, and how to add one, is in
``base``. The summon's rooms never import this package; ``_patching`` does,
when it patches.
"""

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
