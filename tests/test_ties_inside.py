"""A tie made inside a ``rank0_only`` summon, then a nested summon of the tied module (issue 50, item 4).

Inside ``summon_full_params(model, rank0_only=True)`` rank 0's slots hold full
parameters and the other ranks' their shards, so ``side.weight =
blocks[0].fc2.weight`` ties a full tensor on rank 0 and a DTensor elsewhere.
A nested summon of ``side`` used to route by what the slot held: a null
context on rank 0, an all-gather on rank 1, a hang to the group's timeout (a
mismatch within a second under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). Routing
and scope now decide from the registry's record, the same on every rank: the
slot holds a live context's full parameter (rank 0) or its sharded one (the
others), so the enclosing context serves the nested call, with no collective
on any rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

import fsdp_shim

from _faults import short_timeout_mesh
from _helpers import assert_unchanged, build_lm, counting_collectives, patched, rank, shard_lm, snapshot


def _tied_inside(writeback: bool):
    """``side`` (a plain module, not sharded) tied inside a ``rank0_only`` summon; what each rank sees."""
    ref = build_lm()
    model = shard_lm(build_lm(), short_timeout_mesh(10.0))  # a hang ends in seconds
    model.side = nn.Linear(4 * ref.config.width, ref.config.width, bias=False)
    own = model.side.weight
    before = snapshot(model)
    want = ref.blocks[0].fc2.weight
    with patched(), FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        model.side.weight = model.blocks[0].fc2.weight
        with counting_collectives() as counts:
            if writeback:  # the outer call would discard the edits: refused alike, before any collective
                with pytest.raises(RuntimeError, match="enclosing writeback=False"):
                    with FSDP.summon_full_params(model.side):
                        raise AssertionError("the body ran")
            else:
                with FSDP.summon_full_params(model.side, writeback=False):
                    weight = model.side.weight
                    assert weight is model.blocks[0].fc2.weight
                    if rank() == 0:
                        assert not isinstance(weight, DTensor) and torch.equal(weight, want)
                    else:
                        assert isinstance(weight, DTensor)
                with FSDP.summon_full_params(model.side, recurse=False, writeback=False, rank0_only=True):
                    assert model.side.weight is model.blocks[0].fc2.weight
        assert counts == {}, f"the nested call ran collectives: {counts}"
        # the stream reads the tie through the record too: the same gather on every rank
        streamed = dict(fsdp_shim.iter_full_params(model.side, rank0_only=False))
        assert streamed.keys() == {"weight"} and torch.equal(streamed["weight"], want)
        model.side.weight = own
    assert_unchanged(model, before)
    with patched(), FSDP.summon_full_params(model, writeback=False):  # the group is still in step
        assert torch.equal(model.blocks[0].fc2.weight, want)


def rank_a_tie_made_inside_rank0_only_is_served_by_the_enclosing_context(writeback: bool):
    _tied_inside(writeback)


@pytest.mark.parametrize("writeback", [False, True])
def test_a_tie_made_inside_rank0_only_is_served_by_the_enclosing_context(dist_run, writeback):
    dist_run(2, rank_a_tie_made_inside_rank0_only_is_served_by_the_enclosing_context, writeback)
