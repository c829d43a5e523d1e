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
from _faults import (
    InjectedFault,
    assert_untouched,
    inject,
    inject_allocation,
    local_shards,
    outputs_before_first_launch,
    short_timeout_mesh,
    with_grads_on_a_short_timeout,
)
from _helpers import ALL_GATHERS, LMConfig, build_lm, patched, shard_lm, wrapping_dist

CONFIG = LMConfig(layers=3)
SMALL = 0.002  # MiB: many buckets a unit, so a fault can come after the first was posted

FAULTS = {
    # the second all-gather raises before it reaches c10d: the first one was posted
    "all_gather": lambda: inject("all_gather", after=1),
    # batch 1's first output fails: batch 0 (one launch: its outputs allocated first) was posted
    "allocation": lambda model: inject_allocation(after=outputs_before_first_launch(model, SMALL)),
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
    injected = (FAULTS[fault](*[model][:fault == "allocation"]) if faulty and fault != "early_stop"
                else contextlib.nullcontext([0]))
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
    # the summon allocates before its first all-gather and the ranks agree (test_out_of_memory): no allocation
    # of its is part way any more
    ("summon", "all_gather"), ("summon", "interrupt"),
    ("stream", "allocation"), ("stream", "interrupt"), ("stream", "early_stop"),
])
def test_a_one_sided_fault_part_way_is_refused_on_the_faulting_rank(dist_run, caller, fault):
    assert dist_run(2, rank_a_one_sided_fault_part_way_is_refused_on_the_faulting_rank, caller, fault) == [
        "refused", "refused"]


def rank_a_fault_before_any_collective_marks_nothing():
    """An allocation failure before the call's first collective leaves nothing posted on this rank: a fault on
    every rank alike there leaves the group usable (the rule of test_fail_safe, kept)."""
    mesh = short_timeout_mesh(5.0)
    model = shard_lm(build_lm(CONFIG), mesh)
    for caller in ("summon", "stream"):
        with patched(), inject_allocation(after=0), pytest.raises(InjectedFault):
            _run(model, caller)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        pass
    return len(dict(fsdp_shim.iter_full_params(model, rank0_only=False, bucket_mb=SMALL)))


def test_a_fault_before_any_collective_marks_nothing(dist_run):
    counts = dist_run(2, rank_a_fault_before_any_collective_marks_nothing)
    assert counts[0] == counts[1] > 0


def rank_a_fault_at_a_launch_marks_the_group(caller: str):
    """A launch that raises counts as posted ([Note: posted from the attempt] in ``_gather.engine``): from
    outside, c10d refusing a collective and an interrupt right after it posted one look the same. So a fault at
    the first launch, even on every rank alike, marks the group, and every retry is refused at once."""
    mesh = short_timeout_mesh(3.0)
    model = shard_lm(build_lm(CONFIG), mesh)
    before = local_shards(model)
    with patched(), inject("all_gather", after=0), pytest.raises(InjectedFault):
        _run(model, caller)
    assert_untouched(model, before)
    return ["part way" in text for text in _refused_at_once(model)]


@pytest.mark.parametrize("caller", ["summon", "stream"])
def test_a_fault_at_a_launch_marks_the_group(dist_run, caller):
    assert dist_run(2, rank_a_fault_at_a_launch_marks_the_group, caller) == [[True, True]] * 2


@contextlib.contextmanager
def _interrupt_right_after_a_post(after: int):
    """The ``after + 1``-th all-gather reaches c10d and is posted; a ``KeyboardInterrupt`` then lands before its
    ``Work`` is returned (as a real Ctrl-C can, in torch's Python wrapper or right after the call returns)."""
    calls = [0]

    def wrap(name, original):
        def posted_then_interrupted(*args, **kwargs):
            work = original(*args, **kwargs)
            calls[0] += 1
            if calls[0] == after + 1:
                raise KeyboardInterrupt(f"right after all-gather {calls[0]} was posted")
            return work
        return posted_then_interrupted

    with wrapping_dist(ALL_GATHERS, wrap):
        yield calls


def rank_an_interrupt_right_after_a_post_on_one_rank_gives_no_wrong_values(caller: str, after: int):
    """D1 of issue 58. On 0.16.0 the faulting rank was left unmarked: its retry's first all-gather paired with
    the peer's pending next bucket, and both calls *succeeded* with other parameters' shards (same shapes)."""
    mesh = short_timeout_mesh(3.0)
    model = shard_lm(build_lm(CONFIG), mesh)
    before = local_shards(model)
    faulty = dist.get_rank() == dist.get_world_size() - 1  # the last rank: the shortest shards on 3 ranks
    with patched(), (_interrupt_right_after_a_post(after) if faulty else contextlib.nullcontext()):
        with pytest.raises(KeyboardInterrupt if faulty else RuntimeError):  # the peers: a wait times out
            _run(model, caller)
    assert_untouched(model, before)
    words = _refused_at_once(model)  # every rank: no collective, so nothing can pair with a stale one
    assert_untouched(model, before)
    return all("out of step" in text for text in words)


@pytest.mark.one_sided  # by design one rank stops posting: TORCH_DISTRIBUTED_DEBUG=DETAIL would say so first
@pytest.mark.parametrize("caller", ["summon", "stream"])
@pytest.mark.parametrize(("world", "after"), [(2, 0), (2, 1), (3, 0)])
def test_an_interrupt_right_after_a_post_on_one_rank_gives_no_wrong_values(dist_run, caller, world, after):
    assert dist_run(world, rank_an_interrupt_right_after_a_post_on_one_rank_gives_no_wrong_values, caller,
                    after) == [True] * world


def _hsdp_short_timeout_mesh(seconds: float):
    """A 2x2 (replicate, shard) CPU mesh on fresh groups whose collectives time out after ``seconds``."""
    import datetime

    import torch
    from torch.distributed.device_mesh import DeviceMesh

    timeout = datetime.timedelta(seconds=seconds)
    groups = {tuple(ranks): dist.new_group(ranks, timeout=timeout)  # every rank makes every group, in one order
              for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])}
    me = dist.get_rank()
    shard = groups[(0, 1) if me < 2 else (2, 3)]
    replicate = groups[(0, 2) if me % 2 == 0 else (1, 3)]
    return DeviceMesh.from_group([replicate, shard], "cpu", mesh=torch.arange(4).view(2, 2),
                                 mesh_dim_names=("replicate", "shard"))


def rank_an_interrupt_right_after_a_post_under_hsdp_gives_no_wrong_values(caller: str) -> str:
    """D1 under HSDP 2x2: rank 3 is interrupted right after its first all-gather is posted. Its shard group
    (ranks 2 and 3) is refused at once afterwards on both; the other replica (0, 1) finishes that call, exact.
    A summon is a collective of the whole mesh (its ranks agree before they gather: [Note: allocate, agree,
    gather]), so the other replica's next summon waits for ranks that refuse, and times out: never a wrong
    value, never a hang past the group's timeout."""
    mesh = _hsdp_short_timeout_mesh(3.0)
    ref, model = build_lm(CONFIG), shard_lm(build_lm(CONFIG), mesh)
    before = local_shards(model)
    me = dist.get_rank()
    with patched(), (_interrupt_right_after_a_post(0) if me == 3 else contextlib.nullcontext()):
        expected = KeyboardInterrupt if me == 3 else RuntimeError
        with pytest.raises(expected) if me >= 2 else contextlib.nullcontext():
            _run(model, caller) if me >= 2 else (list(fsdp_shim.iter_full_params(model, bucket_mb=SMALL))
                                                 if caller == "stream" else _summon_exact(model, ref))
    assert_untouched(model, before)
    if me >= 2:
        return "refused" if all("out of step" in text for text in _refused_at_once(model)) else "not refused"
    with patched(), pytest.raises(RuntimeError) as timed_out:
        with FSDP.summon_full_params(model, writeback=False):
            raise AssertionError("the body ran")
    assert not isinstance(timed_out.value, fsdp_shim.GroupOutOfStepError), timed_out.value
    assert_untouched(model, before)
    return "exact, then timed out"


def _summon_exact(model, ref) -> None:
    from _helpers import assert_params_equal

    with fsdp_shim.summon_full_params(model, writeback=False, bucket_mb=SMALL):
        assert_params_equal(model, ref)


@pytest.mark.one_sided
@pytest.mark.parametrize("caller", ["summon", "stream"])
def test_an_interrupt_right_after_a_post_under_hsdp_gives_no_wrong_values(dist_run, caller):
    assert dist_run(4, rank_an_interrupt_right_after_a_post_under_hsdp_gives_no_wrong_values, caller) == [
        "exact, then timed out", "exact, then timed out", "refused", "refused"]


def rank_a_one_sided_fault_after_the_gradient_agreement_is_refused_on_the_faulting_rank():
    """``with_grads``: the gradients' agreement (an all-reduce) is the call's first collective, so a fault on one
    rank after it, before that rank's first all-gather, leaves the ranks out of step as a fault part way does: the
    peer goes on to post its gathers. (A refusal every rank makes alike after the agreement keeps them in step:
    ``test_every_rank_alike.test_gradients_laid_out_otherwise_on_some_ranks_are_refused_alike``.)"""
    model, before, faulty = with_grads_on_a_short_timeout(CONFIG)
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
