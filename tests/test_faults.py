"""A fault on the way in never writes back: shards stay bit-identical (2 gloo ranks). See [Note: faults].

Faults are injected at the ``torch.distributed`` boundary (``tests/_faults.py``):
an exception or ``KeyboardInterrupt`` in the all-gather every bucket moves
by, on one rank or on every rank, and a peer that never enters the context.
Each test checks the local shards bit for bit, the parameter objects,
FSDP2's state (idle, sharded) and the registry (empty), with ``writeback``
True and False. A one-sided fault leaves the process group out of step, so
each test runs on a fresh group with a 3 s timeout and never uses it again.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, distribute_tensor

import fsdp_shim
from _faults import InjectedFault, assert_untouched, inject, local_shards, short_timeout_mesh
from _helpers import assert_params_equal, build_lm, patched, rank, shard_lm, tokens_for

#: The operation every bucket moves by.
OPERATION = "all_gather"


def _summon_fails(model, writeback: bool) -> BaseException:
    try:
        with fsdp_shim.summon_full_params(model, writeback=writeback, bucket_mb=0.002):  # several buckets
            raise AssertionError("the body ran although a value never arrived")
    except AssertionError:
        raise
    except BaseException as exc:  # noqa: BLE001  (KeyboardInterrupt included: it is one of the faults)
        return exc
    raise AssertionError("no fault reached the caller")


def rank_a_stalled_peer_writes_nothing(writeback: bool):
    mesh = short_timeout_mesh()
    model = shard_lm(build_lm(), mesh)
    before = local_shards(model)
    if rank() == 1:
        return "stalled"  # never enters: a slow or stuck peer
    with patched():
        with pytest.raises(RuntimeError):  # gloo's timeout (DistBackendError is a RuntimeError)
            with FSDP.summon_full_params(model, writeback=writeback):
                pass
    assert_untouched(model, before)
    return "timed out"


@pytest.mark.parametrize("writeback", [True, False], ids=["writeback", "no-writeback"])
def test_a_stalled_peer_writes_nothing(dist_run, writeback):
    assert dist_run(2, rank_a_stalled_peer_writes_nothing, writeback) == ["timed out", "stalled"]


def rank_an_injected_fault_writes_nothing(where: str, writeback: bool, interrupt: bool):
    mesh = short_timeout_mesh()
    model = shard_lm(build_lm(), mesh)
    with torch.no_grad():
        model(tokens_for(model.config))  # a unit left unsharded too: resharded on entry, still sharded after
    before = local_shards(model)
    faulty = where == "every rank" or rank() == 0
    exception = KeyboardInterrupt if interrupt else InjectedFault
    with patched(), inject(OPERATION, after=1 if faulty else 10**9, exception=exception) as calls:
        caught = _summon_fails(model, writeback)
    assert calls[0] >= 1, f"the gather never called {OPERATION}: the test would prove nothing ({caught!r})"
    if faulty:
        assert isinstance(caught, exception), repr(caught)
    else:
        assert isinstance(caught, RuntimeError), repr(caught)  # its peer failed: this rank timed out
    assert_untouched(model, before)
    return type(caught).__name__


FAULTS = [
    pytest.param(where, writeback, False, id=f"{where}-wb{int(writeback)}")
    for where in ("rank 0", "every rank") for writeback in (True, False)
] + [pytest.param("every rank", True, True, id="KeyboardInterrupt")]


@pytest.mark.parametrize("where, writeback, interrupt", FAULTS)
def test_an_injected_fault_writes_nothing(dist_run, where, writeback, interrupt):
    dist_run(2, rank_an_injected_fault_writes_nothing, where, writeback, interrupt)


def rank_a_fault_in_the_body_still_writes_back_its_edits():
    """FSDP1's rule inside the body: the body's exception propagates, its edits are written back."""
    ref = build_lm()
    model = shard_lm(build_lm())
    with patched(), pytest.raises(ValueError, match="in the body"):
        with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
            model.norm.weight.mul_(2.0)
            raise ValueError("in the body")
    with torch.no_grad():
        ref.norm.weight.mul_(2.0)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        assert_params_equal(model, ref)


def test_a_fault_in_the_body_still_writes_back_its_edits(dist_run):
    dist_run(2, rank_a_fault_in_the_body_still_writes_back_its_edits)


def rank_the_stream_stays_read_only_under_faults(where: str):
    mesh = short_timeout_mesh()
    model = shard_lm(build_lm(), mesh)
    before = local_shards(model)
    faulty = where == "every rank" or rank() == 0
    with patched(), inject(OPERATION, after=1 if faulty else 10**9):
        with pytest.raises(RuntimeError):  # InjectedFault, or the peer's timeout
            for _ in fsdp_shim.iter_full_params(model, rank0_only=False, bucket_mb=0.002):
                pass
    assert_untouched(model, before)


@pytest.mark.parametrize("where", ["rank 0", "every rank"])
def test_the_stream_stays_read_only_under_faults(dist_run, where):
    dist_run(2, rank_the_stream_stays_read_only_under_faults, where)


def rank_a_meta_model_is_refused_before_fsdp2_changes():
    ref = build_lm()
    with torch.device("meta"):
        model = shard_lm(build_lm())
    from fsdp_shim import _fsdp2 as fsdp2

    root = fsdp2.fsdp_state_of(model)
    with patched(), pytest.raises(RuntimeError, match="'embed.weight' is still on the meta device"):
        with FSDP.summon_full_params(model, writeback=False):
            pass
    assert root._is_root is None, "FSDP2's lazy init ran on a meta model"
    with pytest.raises(RuntimeError, match=r"iter_full_params\(\w+\) refused: 'embed.weight' is still on the meta"):
        next(iter(fsdp_shim.iter_full_params(model)))  # the stream refuses in the summon's words
    assert root._is_root is None
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters()):
            p.copy_(distribute_tensor(r.detach(), p.device_mesh, p.placements))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    tokens = tokens_for(ref.config)
    for m, o in ((model, opt), (ref, ref_opt)):  # trains as if never summoned (0.4.3: 'param_dtype' missing)
        m(tokens).pow(2).mean().backward()
        o.step()
    with patched(), FSDP.summon_full_params(model, writeback=False):
        assert_params_equal(model, ref)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_a_meta_model_is_refused_before_fsdp2_changes(dist_run):
    dist_run(2, rank_a_meta_model_is_refused_before_fsdp2_changes)
