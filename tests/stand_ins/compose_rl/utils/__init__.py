"""Stand-in for compose-rl's ``compose_rl.utils`` (not installable here); written for fsdp_shim tests, no upstream code.

Re-exports the MPT generation helpers by name, as upstream's package does.
"""

from compose_rl.utils.utils import flip_pad_token_usage_for_generate, flip_pad_token_usage_in_ffn

__all__ = ["flip_pad_token_usage_for_generate", "flip_pad_token_usage_in_ffn"]
