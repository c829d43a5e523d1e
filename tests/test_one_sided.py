"""A one-sided fault leaves its own mark (issue 51, item 2; 2 gloo ranks, real process groups).

A fault on one rank only (an out-of-memory error while staging, an exception
in an all-gather, a ``KeyboardInterrupt``, the stream's caller stopping
early) after the call posted its first collective, and before it posted its
last, leaves the ranks out of step: the peer has posted collectives this rank
never will. The faulting rank marks its groups itself, so its retry is
refused at once, before any collective, with the recovery in the message;
the peer's pending collective times out (the short-timeout group of
``_faults``) and marks it there. No process aborts, and every shard is
unchanged. Before issue 51 the faulting rank's retry posted at once and
paired with the peer's stale gather (gloo: "Received data size doesn't
match expected size", the process aborted; NCCL: no check at all).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_shim
from _faults import InjectedFault, assert_untouched, inject, inject_allocation, local_shards, short_timeout_mesh
from _helpers import LMConfig, build_lm, patched, shard_lm

CONFIG = LMConfig(layers=3)
SMALL = 0.002  # MiB: many buckets a unit, so a fault can come after the first was posted

FAULTS = {
    # the second all-gather raises before it reaches c10d: the first one was posted
    "all_gather": lambda: inject("all_gather", after=1),
    # the second buffer the shim allocates (bucket 1's output) fails: bucket 0 was posted
    "allocation": lambda: inject_allocation(after=1),
    "interrupt": lambda: inject("all_gather", after=1, exception=KeyboardInterrupt),
}


def _run(model, caller: str, early_stop: bool = False) -> None:
    if caller == "summon":
        with fsdp_shim.summon_full_params(model, writeback=True, bucket_mb=SMALL):
            raise AssertionError("the body ran although a value never arrived")
    for _ in fsdp_shim.iter_full_params(model, rank0_only=False, bucket_mb=SMALL):
        if early_stop:
            break


def _refused_at_once(model) -> list[str]:
    """Refused before any collective (none reaches c10d), so before the group's 3 s timeout could run."""
    words = []
    for attempt in ("summon", "stream"):
        started = time.monotonic()
        with patched(), inject("all_gather", after=10**9) as posted, pytest.raises(
                fsdp_shim.GroupOutOfStepError, match="out of step") as refused:
            if attempt == "summon":
                with FSDP.summon_full_params(model, writeback=False):
                    raise AssertionError("the body ran")
            else:
                next(fsdp_shim.iter_full_params(model))
        assert posted[0] == 0, f"the {attempt} posted {posted[0]} all-gathers before refusing"
        assert time.monotonic() - started < 2.5, f"the {attempt} waited instead of refusing at once"
        words.append(str(refused.value))
    return words


def rank_a_one_sided_fault_part_way_is_refused_on_the_faulting_rank(caller: str, fault: str):
    mesh = short_timeout_mesh(3.0)
    model = shard_lm(build_lm(CONFIG), mesh)
    before = local_shards(model)
    faulty = dist.get_rank() == 0
    injected = FAULTS[fault]() if faulty and fault != "early_stop" else contextlib.nullcontext([0])
    expected = ((InjectedFault, KeyboardInterrupt) if faulty else RuntimeError)  # the peer: its wait times out
    with patched(), injected:
        if faulty and fault == "early_stop":
            _run(model, caller, early_stop=True)  # the caller's break: batch 1 was in flight, batch 2 never posted
        else:
            with pytest.raises(expected):
                _run(model, caller)
    assert_untouched(model, before)
    words = _refused_at_once(model)
    assert_untouched(model, before)
    if faulty:
        for text in words:
            assert "part way" in text and "destroy" in text.lower() and "restart the job" in text, text
    return "refused"


@pytest.mark.one_sided  # by design one rank stops posting: TORCH_DISTRIBUTED_DEBUG=DETAIL would say so first
@pytest.mark.parametrize(("caller", "fault"), [
    ("summon", "all_gather"), ("summon", "allocation"), ("summon", "interrupt"),
    ("stream", "allocation"), ("stream", "interrupt"), ("stream", "early_stop"),
])
def test_a_one_sided_fault_part_way_is_refused_on_the_faulting_rank(dist_run, caller, fault):
    assert dist_run(2, rank_a_one_sided_fault_part_way_is_refused_on_the_faulting_rank, caller, fault) == [
        "refused", "refused"]


def rank_a_fault_before_any_collective_marks_nothing():
    """A fault before the call's first collective leaves nothing posted on this rank: a fault on every rank alike
    there leaves the group usable (the rule of test_fail_safe, kept)."""
    mesh = short_timeout_mesh(5.0)
    model = shard_lm(build_lm(CONFIG), mesh)
    for fault in (lambda: inject("all_gather", after=0), lambda: inject_allocation(after=0)):
        for caller in ("summon", "stream"):
            with patched(), fault(), pytest.raises(InjectedFault):
                _run(model, caller)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        pass
    return len(dict(fsdp_shim.iter_full_params(model, rank0_only=False, bucket_mb=SMALL)))


def test_a_fault_before_any_collective_marks_nothing(dist_run):
    counts = dist_run(2, rank_a_fault_before_any_collective_marks_nothing)
    assert counts[0] == counts[1] > 0


def rank_a_one_sided_fault_after_the_gradient_agreement_is_refused_on_the_faulting_rank():
    """``with_grads``: the gradients' agreement (an all-reduce) is the call's first collective, so a fault on one
    rank after it, before that rank's first all-gather, leaves the ranks out of step as a fault part way does: the
    peer goes on to post its gathers. (A refusal every rank makes alike after the agreement keeps them in step:
    ``test_every_rank_alike.test_gradients_laid_out_otherwise_on_some_ranks_are_refused_alike``.)"""
    import torch

    mesh = short_timeout_mesh(3.0)
    model = shard_lm(build_lm(CONFIG), mesh)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    before = local_shards(model)
    faulty = dist.get_rank() == 0
    with patched(), inject("all_gather", after=0 if faulty else 10**9), pytest.raises(
            InjectedFault if faulty else RuntimeError):
        with fsdp_shim.summon_full_params(model, writeback=False, with_grads=True, bucket_mb=SMALL):
            raise AssertionError("the body ran although a value never arrived")
    assert_untouched(model, before)
    for text in _refused_at_once(model):
        assert "out of step" in text and (not faulty or "part way" in text), text
    return "refused"


@pytest.mark.one_sided  # by design one rank stops posting: TORCH_DISTRIBUTED_DEBUG=DETAIL would say so first
def test_a_one_sided_fault_after_the_gradient_agreement_is_refused_on_the_faulting_rank(dist_run):
    assert dist_run(2, rank_a_one_sided_fault_after_the_gradient_agreement_is_refused_on_the_faulting_rank) == [
        "refused", "refused"]
