"""Stand-in for ``composer.models``."""

from composer.models.huggingface import HuggingFaceModel

__all__ = ["HuggingFaceModel"]
