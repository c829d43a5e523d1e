"""Stand-in for ``composer.utils.misc`` at mosaicml 0.32.1: the released ``is_model_fsdp`` rule.

Released Composer recognises only FSDP1: the model itself or one of its
direct children must be a ``FullyShardedDataParallel``, whose class the
function imports when called (so there is no module global to swap).
Composer main (#3907) also accepts ``FSDPModule``; no release has it yet.
"""

from __future__ import annotations

import torch.nn as nn


def is_model_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` (or a direct child) is FSDP1-wrapped; FSDP2 units do not count here."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in (model, *model.children()))
