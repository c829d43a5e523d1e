"""Two models of one architecture sharded on different process groups (issue 50, item 7).

``DeviceMesh.__eq__`` ignores process groups, so torch hands the second
model's DTensors a spec whose mesh is the first model's (its spec caches
map equal meshes to one another). The shim used to take the group from the
DTensor's mesh, so it gathered the second model over the first model's
group: right values where both groups hold the same ranks, wrong ones
otherwise. FSDP2 keeps using its own ``mesh_info``; the shim reads the group
of an FSDP2 parameter there too, for the gather, the group checks and the
claims.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

import fsdp_shim
from _helpers import ALL_GATHERS, assert_params_equal, build_lm, patched, shard_lm, tokens_for, wrapping_dist

_GATHERS = ALL_GATHERS


@contextlib.contextmanager
def recording_groups():
    """The ``group`` argument of every all-gather issued through ``torch.distributed``."""
    seen: list[object] = []

    def wrap(name, function):
        def call(*args, **kwargs):
            seen.append(kwargs.get("group", args[2] if len(args) > 2 else None))
            return function(*args, **kwargs)
        return call

    with wrapping_dist(_GATHERS, wrap):
        yield seen


def _mesh_on_new_group() -> tuple[DeviceMesh, dist.ProcessGroup]:
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=30))
    return DeviceMesh.from_group(group, "cpu"), group


def _two_models():
    mesh_a, group_a = _mesh_on_new_group()
    mesh_b, group_b = _mesh_on_new_group()
    ref = build_lm(seed=1)
    model_a = shard_lm(build_lm(seed=0), mesh_a)
    model_b = shard_lm(build_lm(seed=1), mesh_b)
    tokens = tokens_for(ref.config)
    model_a(tokens), model_b(tokens)  # FSDP2's lazy init (specs may be handed around from here)
    return ref, model_a, group_a, model_b, group_b


def rank_each_model_is_gathered_over_its_own_group():
    ref, model_a, group_a, model_b, group_b = _two_models()
    with patched():
        with recording_groups() as seen, FSDP.summon_full_params(model_b, writeback=False):
            assert_params_equal(model_b, ref)
        assert seen and all(g is group_b for g in seen), (
            f"model_b gathered over {sum(g is group_a for g in seen)} of {len(seen)} collectives on model_a's group")
        with recording_groups() as seen:  # per unit, as weight sync does
            for unit in (*model_b.blocks, model_b):
                with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                    pass
        assert seen and all(g is group_b for g in seen)
        with recording_groups() as seen:
            streamed = dict(fsdp_shim.iter_full_params(model_b, rank0_only=False))
        assert all(torch.equal(streamed[n], p) for n, p in ref.named_parameters())
        assert seen and all(g is group_b for g in seen)
        # writeback lands in model_b's own shards
        with FSDP.summon_full_params(model_b, writeback=True):
            with torch.no_grad():
                model_b.norm.weight.add_(1.0)
        with FSDP.summon_full_params(model_b, writeback=False):
            assert torch.equal(model_b.norm.weight, ref.norm.weight + 1.0)
        with torch.no_grad():
            ref.norm.weight.add_(1.0)
        # gradients: agreed and gathered over model_b's group too
        ref(tokens_for(ref.config)).sum().backward()
        model_b(tokens_for(ref.config)).sum().backward()
        with recording_groups() as seen, counting_reduces() as reduced:
            with FSDP.summon_full_params(model_b, writeback=False, with_grads=True):
                for (name, p), r in zip(model_b.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}.grad: {m}")
        assert seen and all(g is group_b for g in seen)
        assert reduced and all(g is group_b for g in reduced)
    assert all(isinstance(p, DTensor) for p in model_b.parameters())


@contextlib.contextmanager
def counting_reduces():
    """The ``group`` argument of every ``all_reduce`` issued through ``torch.distributed``."""
    seen: list[object] = []

    def wrap(name, original):
        def call(*args, **kwargs):
            seen.append(kwargs.get("group"))
            return original(*args, **kwargs)
        return call

    with wrapping_dist(("all_reduce",), wrap):
        yield seen


def test_each_model_is_gathered_over_its_own_group(dist_run):
    dist_run(2, rank_each_model_is_gathered_over_its_own_group)


def rank_a_destroyed_first_group_leaves_the_second_model_gatherable():
    """The first model's group destroyed: the second model's summon and stream never touch it."""
    ref, model_a, group_a, model_b, group_b = _two_models()
    dist.destroy_process_group(group_a)
    with patched():
        with FSDP.summon_full_params(model_b, writeback=False):
            assert_params_equal(model_b, ref)
        streamed = dict(fsdp_shim.iter_full_params(model_b, rank0_only=False))
        assert all(torch.equal(streamed[n], p) for n, p in ref.named_parameters())


def test_a_destroyed_first_group_leaves_the_second_model_gatherable(dist_run):
    dist_run(2, rank_a_destroyed_first_group_leaves_the_second_model_gatherable)
