"""Stand-in for ``composer.utils``: re-exports the gate by name, as upstream's package does."""

from composer.utils.misc import is_model_fsdp

__all__ = ["is_model_fsdp"]
