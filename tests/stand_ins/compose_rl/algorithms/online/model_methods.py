"""Stand-in for compose-rl's algorithm enums (only what the weight sync reads)."""

from enum import Enum


class OnPolicyEnum(str, Enum):
    PPO = "ppo"
    GRPO = "grpo"


class ALGORITHM_TYPE:  # noqa: N801  (upstream's spelling)
    CRITIC_FREE = {OnPolicyEnum.GRPO}
