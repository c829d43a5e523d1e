"""Bounded run-ahead (issue 51, item 1): a rank that receives nothing never has more than two buckets (the
summon) or batches (the stream) posted ahead of the last one it saw complete.

On NCCL ``work.wait()`` returns at once on the host (it only orders the current stream) and the watchdog
times each collective from its post. These tests emulate that on a real gloo group (2 ranks, no mock of
torch.distributed): ``dist``'s all-gather is wrapped at the boundary, as ``_faults`` does, so that on rank 1
the returned work's ``wait()`` returns immediately while the real gloo work goes on underneath, and rank 0
posts each all-gather late (a slow consumer). Each post on rank 1 records how many of its posted works have
not completed (their futures not done). Unbounded (0.12.0), rank 1 posted the whole sync at once (measured:
21 of 21 buckets of a summon unfinished; 22 of 22 in the stream).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _helpers import ALL_GATHERS, LMConfig, assert_params_equal, build_lm, patched, shard_lm, wrapping_dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

import fsdp_shim
from fsdp_shim._gather.layout import bucket_cap, bucket_plan

# --------------------------------------------------------------------------- bounded run-ahead
_ALL_GATHERS = ALL_GATHERS


class _ReturnsAtOnce:
    """A posted all-gather whose ``wait()`` returns at once, as NCCL's does on the host; the gloo work goes on."""

    def __init__(self, work, held):
        self._work, self._held = work, held  # its buffers held: the engine may drop them while gloo writes

    def wait(self, timeout=None):
        return True

    def __getattr__(self, name):  # is_completed, get_future, ...: the real work's
        return getattr(self._work, name)


@contextlib.contextmanager
def nccl_like_waits(late_s: float = 0.03) -> Iterator[list[int]]:
    """On rank 1: waits that return at once; each post records its posted works not yet completed. On rank 0:
    each all-gather posted ``late_s`` late. Yields rank 1's record; every real work is waited for on exit."""
    posted: list[_ReturnsAtOnce] = []
    unfinished: list[int] = []

    def wrap(name, original):
        def post(*args, **kwargs):
            if dist.get_rank() == 0:
                time.sleep(late_s)
                return original(*args, **kwargs)
            work = _ReturnsAtOnce(original(*args, **kwargs), args)
            posted.append(work)
            # completed: its future done (gloo marks the future before is_completed() flips: counted by
            # is_completed(), the same runs peak one higher, a lag of microseconds, not a post ahead)
            unfinished.append(sum(not w.get_future().done() for w in posted))
            return work

        return post

    try:
        with wrapping_dist(_ALL_GATHERS, wrap):
            yield unfinished
    finally:
        for work in posted:
            work._work.wait()


CONFIG = LMConfig(layers=4)
SMALL = 0.002  # MiB: many buckets


def rank_a_rank_that_receives_nothing_stays_two_buckets_ahead_in_a_summon():
    model, ref = shard_lm(build_lm(CONFIG)), build_lm(CONFIG)
    with patched(), nccl_like_waits() as unfinished:
        with fsdp_shim.summon_full_params(model, writeback=False, rank0_only=True, bucket_mb=SMALL):
            if dist.get_rank() == 0:
                assert_params_equal(model, ref)
    return max(unfinished, default=0), len(unfinished)


def test_a_rank_that_receives_nothing_stays_two_buckets_ahead_in_a_summon(dist_run):
    (_, none), (peak, posts) = dist_run(2, rank_a_rank_that_receives_nothing_stays_two_buckets_ahead_in_a_summon)
    assert none == 0 and posts > 10, posts  # rank 0 records nothing; many buckets on rank 1
    assert peak <= 2, f"rank 1 had {peak} all-gathers posted and unfinished (of {posts})"


def rank_a_rank_that_receives_nothing_stays_two_units_ahead_in_a_per_unit_loop():
    config = LMConfig(layers=8)
    model, ref = shard_lm(build_lm(config)), build_lm(config)
    expected = dict(ref.named_parameters())
    with patched(), nccl_like_waits() as unfinished:
        for unit_name, unit in fsdp_shim.fsdp_units(model):  # compose-rl's weight sync: a summon a unit
            with FSDP.summon_full_params(unit, writeback=False, rank0_only=True, recurse=False):
                if dist.get_rank() == 0:
                    for name, param in unit.named_parameters():
                        if not isinstance(param, DTensor):
                            fqn = f"{unit_name}.{name}" if unit_name else name
                            assert torch.equal(param, expected[fqn].detach()), fqn
    return max(unfinished, default=0), len(unfinished)


def test_a_rank_that_receives_nothing_stays_two_units_ahead_in_a_per_unit_loop(dist_run):
    # across calls: 0.13.0 bounded each summon's own buckets only, and a unit is one bucket (measured: 9 of 9)
    (_, none), (peak, posts) = dist_run(2, rank_a_rank_that_receives_nothing_stays_two_units_ahead_in_a_per_unit_loop)
    assert none == 0 and posts == 9, posts  # 8 blocks and the root, one all-gather each
    assert peak <= 2, f"rank 1 had {peak} all-gathers posted and unfinished (of {posts})"


def _launches_per_batch(model, bucket_mb: float) -> list[int]:
    """A batch's buckets share launches where they can ([Note: one launch a group]): posts are launches."""
    from fsdp_shim._stream import batch_params

    cap = bucket_cap(bucket_mb).bucket_bytes
    return [len(bucket_plan([t for t in b.tensors if isinstance(t, DTensor)], cap, together=True).launches)
            for b in batch_params(model, cap, None)]


def rank_a_rank_that_receives_nothing_stays_two_batches_ahead_in_the_stream(bucket_mb: float):
    model, ref = shard_lm(build_lm(CONFIG)), build_lm(CONFIG)
    per_batch = _launches_per_batch(model, bucket_mb)
    expected = dict(ref.named_parameters())
    received = 0
    with nccl_like_waits() as unfinished:
        for name, full in fsdp_shim.iter_full_params(model, bucket_mb=bucket_mb):  # rank0_only: rank 0 receives
            if dist.get_rank() == 0:
                assert torch.equal(full, expected[name].detach()), name
                received += 1
            else:
                assert full is None
    bound = max(a + b for a, b in zip(per_batch, per_batch[1:], strict=False)) if len(per_batch) > 1 else per_batch[0]
    return max(unfinished, default=0), len(unfinished), len(per_batch), bound, received


@pytest.mark.parametrize("bucket_mb", [SMALL, 0.06], ids=["many-buckets-a-batch", "a-bucket-a-batch"])
def test_a_rank_that_receives_nothing_stays_two_batches_ahead_in_the_stream(dist_run, bucket_mb):
    results = dist_run(2, rank_a_rank_that_receives_nothing_stays_two_batches_ahead_in_the_stream, bucket_mb)
    (_, _, batches, _, received), (peak, posts, _, bound, _) = results
    assert received > 0 and batches >= 4, results
    assert peak <= bound < posts, f"rank 1 had {peak} all-gathers posted and unfinished (two batches: {bound})"
