"""Stand-in for compose-rl's vLLM weight sync, same structure, our own code.

See ``tests/stand_ins/README.md``. The engine is a recorder: ``RecordingEngine``
keeps ``(name, dtype, shape, tensor)`` for each weight rank 0 sends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from compose_rl.algorithms.online.model_methods import ALGORITHM_TYPE, OnPolicyEnum


class RecordingEngine:
    """What an inference engine received, in order."""

    def __init__(self) -> None:
        self.received: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]] = []

    def update_weight(self, name: str, dtype: torch.dtype, shape: torch.Size, tensor: torch.Tensor) -> None:
        self.received.append((name, dtype, tuple(shape), tensor.detach().to("cpu", copy=True)))


def build_param_fullnames(top_module: nn.Module) -> dict:
    """Parameter object -> dotted name, walking the tree depth first (a tie keeps the last name)."""
    names = {}

    def visit(module: nn.Module, prefix: str) -> None:
        for local, param in module.named_parameters(recurse=False):
            names[param] = f"{prefix}.{local}" if prefix else local
        for child_name, child in module.named_children():
            visit(child, f"{prefix}.{child_name}" if prefix else child_name)

    visit(top_module, "")
    return names


def simplify_param_path(path: str) -> str:
    """Drop wrapper and container parts of a name; everything but the head lives under ``model.``."""
    dropped = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "lm_backbone", "model")
    kept = [] if "lm_head" in path else ["model"]
    kept += [part for part in path.split(".") if not any(d in part for d in dropped)]
    return ".".join(kept)


def is_fsdp_leaf(module: nn.Module) -> bool:
    if not isinstance(module, FSDP):
        return False
    return not any(sub is not module and isinstance(sub, FSDP) for sub in module.modules())


def should_update_torch_module(parsed_name, full_name, module, loss_type, valid_non_leaf_names) -> bool:
    if is_fsdp_leaf(module):
        return True
    if parsed_name not in valid_non_leaf_names:
        return False
    if loss_type in ALGORITHM_TYPE.CRITIC_FREE:
        return True
    return loss_type == OnPolicyEnum.PPO and "lm_backbone" in full_name


def broadcast_to_vllm(model: nn.Module, engines: list, loss_type: OnPolicyEnum = OnPolicyEnum.PPO) -> int:
    """Send every policy weight to every engine, unit by unit; returns how many were sent."""
    if loss_type == OnPolicyEnum.PPO:
        num_params = len(list(model.model.lm_backbone.named_parameters()))
    elif loss_type in ALGORITHM_TYPE.CRITIC_FREE:
        num_params = len(list(model.model.named_parameters()))
    else:
        raise ValueError(f"unsupported loss type {loss_type}")
    valid_non_leaf_names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    seen_units = set()
    seen_names = set()
    count = 0
    param_2_full_name = build_param_fullnames(model)

    with torch.no_grad():
        model({"obs": torch.zeros(1, 1, dtype=torch.long)})  # the dummy forward upstream runs

    for module_name, module in model.named_modules():
        if isinstance(module, FSDP):
            if module_name == "model" and loss_type == OnPolicyEnum.PPO:
                continue
            if module in seen_units:
                continue
            seen_units.add(module)
            with FSDP.summon_full_params(module, writeback=False, rank0_only=True, recurse=False):
                for _, param in module.named_parameters(recurse=True):
                    if dist.get_rank() != 0:
                        continue
                    full_name = param_2_full_name[param]
                    parsed_name = simplify_param_path(full_name)
                    if "critic_head" in parsed_name:
                        continue
                    update = should_update_torch_module(
                        parsed_name, full_name, module, loss_type, valid_non_leaf_names
                    )
                    if parsed_name in seen_names:
                        continue
                    if update:
                        seen_names.add(parsed_name)
                        count += 1
                        for engine in engines:
                            engine.update_weight(parsed_name, param.dtype, param.shape, param.data)

    if dist.get_rank() == 0:
        assert num_params == count, (
            f"Number of parameters updated {count} does not match the number of parameters {num_params}"
        )
    return count
