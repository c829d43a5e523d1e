"""Stand-in for compose-rl's vLLM weight sync (main, ae56991), same structure, our own code.

See ``tests/stand_ins/README.md``. Upstream, rank 0 announces each weight to
every engine through Ray (``engine.update_weight.remote(name, dtype, shape)``)
and then broadcasts its tensor on ``model_update_group``, a process group of
rank 0 and the engines' workers, while the other training ranks go straight
on to the next unit. Here the engine is a process of the same job:
``EngineHandle`` announces on the update group itself (in place of Ray's
call) and ``serve_engine`` plays the engine's worker, receiving exactly as
upstream's worker does: allocate, then ``broadcast`` from rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from compose_rl.algorithms.online.model_methods import ALGORITHM_TYPE, OnPolicyEnum

Received = list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]]


class _Remote:
    """Ray's ``handle.method.remote(...)`` call shape."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.remote = method


class EngineHandle:
    """Rank 0's handle on one engine: announces each weight on the update group, before the broadcast."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.update_weight = _Remote(self._announce)

    def _announce(self, name: str, dtype: torch.dtype, shape: torch.Size, empty_cache: bool = False) -> str:
        dist.broadcast_object_list([(name, dtype, tuple(shape))], src=0, group=self.group)
        return name

    def close(self) -> None:
        """Tell the engine the sync is over (upstream: ``ray.get`` on the refs)."""
        dist.broadcast_object_list([None], src=0, group=self.group)


def serve_engine(group: dist.ProcessGroup | None, device: torch.device) -> Received:
    """The engine's worker: receive announced weights until rank 0 closes; what arrived, in order."""
    received: Received = []
    while True:
        announcement: list[Any] = [None]
        dist.broadcast_object_list(announcement, src=0, group=group, device=device)
        if announcement[0] is None:
            return received
        name, dtype, shape = announcement[0]
        weight = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(weight, 0, group=group)
        received.append((name, dtype, shape, weight.cpu()))


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


def broadcast_to_vllm(
    model: nn.Module,
    vllm_engines: list,
    model_update_group: dist.ProcessGroup | None,
    batch: dict[str, torch.Tensor],
    loss_type: OnPolicyEnum = OnPolicyEnum.PPO,
    enable_prefix_caching: bool = False,
) -> int:
    """Send every policy weight to every engine, unit by unit; returns how many were sent (on rank 0)."""
    if loss_type == OnPolicyEnum.PPO:
        num_params = len(list(model.model.lm_backbone.named_parameters()))
    elif loss_type in ALGORITHM_TYPE.CRITIC_FREE:
        num_params = len(list(model.model.named_parameters()))
    else:
        raise ValueError(f"unsupported loss type {loss_type}")
    refs = []
    device = batch["prompt"].device
    valid_non_leaf_names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    seen_units = set()
    seen_names = set()
    count = 0
    param_2_full_name = build_param_fullnames(model)

    with torch.no_grad():
        model({"obs": torch.tensor([[0]], dtype=torch.long, device=device)})  # the dummy forward upstream runs

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
                        refs += [
                            engine.update_weight.remote(
                                parsed_name, dtype=param.dtype, shape=param.shape, empty_cache=count == num_params
                            )
                            for engine in vllm_engines
                        ]
                        dist.broadcast(param.data, 0, group=model_update_group)

    if dist.get_rank() == 0:
        assert num_params == count, (
            f"Number of parameters updated {count} does not match the number of parameters {num_params}"
        )
    return count
