"""``_health``: claims on process groups, per thread and per owner (no process group is needed: claims key
groups by identity); out of step and destroyed groups on real groups; the run-ahead record, per group;
through ``FSDP.summon_full_params``, a group another thread's context uses, and a destroyed one, refused."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp_shim
from _helpers import patched
from _helpers import reference_and_sharded as _models
from fsdp_shim import _health as health


def _claims_in_another_thread(group: object) -> str | None:
    """What claiming ``group`` in a new thread raises (None: claimed, and given back)."""
    said: list[str | None] = []

    def claim() -> None:
        owner = object()
        try:
            health.claim(owner, health.current_thread(), [group], lambda: "the call")  # type: ignore[list-item]
        except RuntimeError as error:
            said.append(str(error))
        else:
            said.append(None)
        finally:
            health.release(owner)

    thread = threading.Thread(target=claim)
    thread.start()
    thread.join()
    return said[0]


def test_claims_are_per_thread_and_per_owner():
    group_a, group_b = object(), object()
    me = health.current_thread()
    outer, nested = object(), object()
    health.claim(outer, me, [group_a], lambda: "outer", context=True)  # type: ignore[list-item]
    health.claim(nested, me, [group_a, group_b], lambda: "nested", context=True)  # type: ignore[list-item]
    refused = _claims_in_another_thread(group_b)
    assert refused is not None and refused.startswith("the call refused: another thread"), refused
    assert set(health._claims) == {id(outer), id(nested)}  # the refused claim took nothing
    health.release(nested)
    health.release(nested)  # a second release (an interrupted exit's second pass) gives back nothing more
    assert health.has_live_context(me)
    assert _claims_in_another_thread(group_b) is None  # only the outer claim is left: group_a
    assert _claims_in_another_thread(group_a) is not None
    health.claim(outer, me, [group_b], lambda: "with_grads' other mesh")  # type: ignore[list-item]  # adds
    assert _claims_in_another_thread(group_b) is not None
    health.release(outer)
    assert not health.has_live_context(me)
    assert _claims_in_another_thread(group_a) is None  # free again once every claim is given back
    assert health._claims == {}


def rank_group_health_on_real_groups():
    """``require_live_groups`` passes a live group; refuses a destroyed one and one marked out of step, each
    with its own typed error, naming the user and (out of step) what the failed wait raised; a part-way mark
    says so; the failed collective's buffers are held for as long as the group lives."""
    import pytest
    import torch.distributed as dist

    from fsdp_shim import DestroyedGroupError, GroupOutOfStepError

    ranks = list(range(dist.get_world_size()))
    live, marked, part_way, destroyed = (dist.new_group(ranks) for _ in range(4))
    health.require_live_groups([live, marked, part_way, destroyed], lambda: "x")
    buffer = torch.ones(3)
    health.mark_out_of_step(marked, TimeoutError("the wait timed out\nsecond line"), [buffer])
    health.mark_part_way([part_way], MemoryError("out of memory"))
    dist.destroy_process_group(destroyed)
    health.require_live_groups([live], lambda: "x")
    with pytest.raises(GroupOutOfStepError, match=r"cannot gather the model: .*\(TimeoutError: the wait timed out\)"):
        health.require_live_groups([live, marked], lambda: "the model")
    with pytest.raises(GroupOutOfStepError, match="this rank left a gather part way on MemoryError: out of memory"):
        health.require_live_groups([part_way], lambda: "the model")
    with pytest.raises(DestroyedGroupError, match="cannot gather the model: its device mesh uses a process group"):
        health.require_live_groups([destroyed], lambda: "the model")
    assert health._out_of_step[marked][1] == [buffer]  # never freed under a late peer
    return dist.get_rank()


def test_group_health_on_real_groups(dist_run):
    assert dist_run(2, rank_group_health_on_real_groups) == [0, 1]
