"""The weight sync as RL stacks run it: ranks 0 and 1 train, rank 2 is the engine on a second group.

compose-rl's ``broadcast_to_vllm`` (the stand-in at its upstream path, see
``tests/stand_ins/README.md``) runs the per-unit ``summon_full_params(unit,
recurse=False, writeback=False, rank0_only=True)`` loop; inside each context
rank 0 alone broadcasts every full parameter on the model-update group
{0, 2}, while rank 1 leaves at once and enters the next unit's gather. The
engine (rank 2) must receive exactly what it receives from FSDP1, in order,
and nobody may hang: every group here has a short timeout, so a wait that
would hang raises instead, and a dropped rank ends in an error on the
others. ``iter_full_params`` in the same shape. See
``docs/troubleshooting.md`` for the ordering rule this relies on.
"""

from __future__ import annotations

import datetime
import itertools
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp_shim
from _faults import InjectedFault, assert_untouched, inject, local_shards
from _helpers import patch_state_restored, patched, rank
from fsdp_shim.tools.launch import rank_device
from fsdp_shim.tools.models import gloo_average_sums
from test_clients import ComposerModel, fsdp1_model, fsdp2_model, weight_sync_module

#: Every group's timeout: long enough for a loaded CI machine, short enough that a hang fails fast.
TIMEOUT_S = 20.0
#: The dropped-rank tests' timeout: the error must come within it (plus start-up).
DROP_TIMEOUT_S = 3.0
ENGINE = 2
_meshes_made = itertools.count()


def _groups(timeout_s: float = TIMEOUT_S) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The training group {0, 1} and the model-update group {0, 2}: fresh ones (a collective of all 3 ranks)."""
    gloo_average_sums()  # cached after its first call, a probe on the default group: every rank takes part
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.new_group([0, 1], timeout=timeout), dist.new_group([0, ENGINE], timeout=timeout)


def _device() -> torch.device:
    """This rank's device: the CPU on gloo; its GPU on NCCL (``FSDP_SHIM_TEST_BACKEND``: ``conftest``)."""
    return rank_device("cpu" if dist.get_backend() == "gloo" else "cuda")


def _mesh(train: dist.ProcessGroup) -> DeviceMesh:
    """The training ranks' mesh, named apart from every other (see ``_faults.short_timeout_mesh``)."""
    return DeviceMesh.from_group(train, _device().type, mesh_dim_names=(f"train{next(_meshes_made)}",))


def _sync(build, layout: str, update: dist.ProcessGroup, *, close: bool = True):
    """On a training rank: compose-rl's sync of the model ``build()`` makes; rank 0 then closes the engine."""
    vllm_utils = weight_sync_module()
    from compose_rl.algorithms.online.model_methods import OnPolicyEnum  # noqa: PLC0415

    handle = vllm_utils.EngineHandle(update)
    try:
        batch = {"prompt": torch.zeros(1, 1, dtype=torch.long, device=_device())}
        return vllm_utils.broadcast_to_vllm(build(), [handle], update, batch, OnPolicyEnum(layout))
    finally:
        if close and rank() == 0:
            handle.close()


def _serve(update: dist.ProcessGroup):
    return weight_sync_module().serve_engine(update, _device())


def _assert_same(got, want) -> None:
    assert [r[:3] for r in got] == [r[:3] for r in want]  # names, dtypes, shapes, in order
    for (name, *_, a), (*_, b) in zip(got, want):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- compose-rl's loop
def rank_engine_receives_what_fsdp1_sends(layout: str, tie: bool):
    train, update = _groups()
    started = time.monotonic()
    if rank() == ENGINE:
        on_fsdp1, on_fsdp2 = _serve(update), _serve(update)
        _assert_same(on_fsdp2, on_fsdp1)
        reference = ComposerModel(layout, tie)
        lm = reference.model.lm_backbone if layout == "ppo" else reference.model
        assert len(on_fsdp2) == len(list(lm.named_parameters())) > 0
        return [r[0] for r in on_fsdp2], time.monotonic() - started
    with patched():
        _sync(lambda: fsdp1_model(layout, tie, train, _device()), layout, update)
        _sync(lambda: fsdp2_model(layout, tie, _mesh(train)), layout, update)
    return None, time.monotonic() - started


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", ["ppo", "grpo"])
def test_engine_receives_what_fsdp1_sends(dist_run, layout, tie):
    results = dist_run(3, rank_engine_receives_what_fsdp1_sends, layout, tie)
    names = results[ENGINE][0]
    assert ("lm_head.weight" in names) and ("model.embed_tokens.weight" in names) != tie
    assert all(elapsed < 3 * TIMEOUT_S for _, elapsed in results)  # a liveness bound, not a timing


def rank_without_the_shim_nothing_is_sent(how: str):
    train, update = _groups()
    if rank() == ENGINE:
        return _serve(update)
    with patch_state_restored("FSDP_SHIM_DISABLE_COMPOSE_RL"):
        fsdp_shim.unpatch()
        if how == "instrumentation off":
            import os  # noqa: PLC0415

            os.environ["FSDP_SHIM_DISABLE_COMPOSE_RL"] = "1"
            fsdp_shim.patch()
        build = lambda: fsdp2_model("ppo", True, _mesh(train))  # noqa: E731
        if rank() == 0:
            with pytest.raises(AssertionError, match="Number of parameters updated 0"):
                _sync(build, "ppo", update)
        else:
            _sync(build, "ppo", update)
    return None


@pytest.mark.parametrize("how", ["unpatched", "instrumentation off"])
def test_without_the_shim_or_its_instrumentation_nothing_is_sent(dist_run, how):
    assert dist_run(3, rank_without_the_shim_nothing_is_sent, how)[ENGINE] == []


def rank_fsdp1_sends_the_same_with_and_without_the_shim(layout: str):
    train, update = _groups()
    if rank() == ENGINE:
        without, with_shim = _serve(update), _serve(update)
        _assert_same(with_shim, without)
        return len(with_shim)
    with patch_state_restored():
        fsdp_shim.unpatch()
        _sync(lambda: fsdp1_model(layout, True, train), layout, update)
        fsdp_shim.patch()
        _sync(lambda: fsdp1_model(layout, True, train), layout, update)
    return None


@pytest.mark.parametrize("layout", ["ppo", "grpo"])
def test_fsdp1_sends_the_same_with_and_without_the_shim(dist_run, layout):
    assert dist_run(3, rank_fsdp1_sends_the_same_with_and_without_the_shim, layout)[ENGINE] > 0


# --------------------------------------------------------------------------- iter_full_params
def rank_stream_to_the_engine(dtype: torch.dtype | None):
    """New code: ``iter_full_params`` on the training ranks, rank 0 broadcasting each tensor as it comes."""
    train, update = _groups()
    reference = dict(ComposerModel("grpo", True).model.named_parameters())
    if rank() == ENGINE:
        received = _serve(update)
        root = [n for n in reference if ".layers." not in n]  # the root unit's own, then unit by unit
        layers = [n for n in reference if ".layers." in n]
        assert [r[0] for r in received] == root + layers
        for name, got_dtype, _, tensor in received:
            want = reference[name].detach()
            want = want if dtype is None else want.to(dtype)
            assert got_dtype == want.dtype and torch.equal(tensor, want), name
        return len(received)
    model = fsdp2_model("grpo", True, _mesh(train))
    handle = weight_sync_module().EngineHandle(update)
    with patched():
        for name, full in fsdp_shim.iter_full_params(model.model, dtype=dtype):
            if rank() == 0:
                handle.update_weight.remote(name, dtype=full.dtype, shape=full.shape)
                dist.broadcast(full, 0, group=update)
    if rank() == 0:
        handle.close()
    return None


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_stream_to_an_engine_on_a_second_group(dist_run, dtype):
    assert dist_run(3, rank_stream_to_the_engine, dtype)[ENGINE] > 0


# --------------------------------------------------------------------------- a dropped rank
def _shim_gathers_to_skip(model) -> int:
    """How many all-gathers the sync makes before the shim's first gather (its dummy forward: FSDP2's own)."""
    dummy = {"obs": torch.zeros(1, 1, dtype=torch.long)}
    with torch.no_grad():
        model(dummy)  # the first forward (lazy init) leaves the root unsharded: the sync's is a later one
        with inject("all_gather", after=10**9) as calls:
            model(dummy)
    return calls[0]


def rank_a_dropped_rank_ends_in_an_error(who: str):
    """``trainer``: rank 1 dies in its third gather. ``engine``: rank 2 leaves after two weights.

    Every other rank must end in an error within the groups' timeout, and the
    training ranks' parameters must be exactly as they were.
    """
    train, update = _groups(DROP_TIMEOUT_S)
    started = time.monotonic()
    if rank() == ENGINE:
        vllm_utils = weight_sync_module()
        if who == "engine":
            for _ in range(2):
                announcement = [None]
                dist.broadcast_object_list(announcement, src=0, group=update)
                name, dtype, shape = announcement[0]
                dist.broadcast(torch.empty(shape, dtype=dtype), 0, group=update)
            return "left", time.monotonic() - started
        with pytest.raises(RuntimeError):
            vllm_utils.serve_engine(update, torch.device("cpu"))  # rank 0 never closes
        return "timed out", time.monotonic() - started
    model = fsdp2_model("grpo", True, _mesh(train))
    skip = _shim_gathers_to_skip(model)
    before = local_shards(model)
    outcome = "finished"
    with patched():
        try:
            if who == "trainer" and rank() == 1:
                with inject("all_gather", after=skip + 2):
                    _sync(lambda: model, "grpo", update, close=False)
            else:
                _sync(lambda: model, "grpo", update, close=False)
        except InjectedFault:
            outcome = "dropped"
        except RuntimeError as error:  # gloo: a timeout, or a peer that closed its connection
            outcome = f"error: {type(error).__name__}"
    assert_untouched(model, before)
    return outcome, time.monotonic() - started


@pytest.mark.parametrize("who", ["trainer", "engine"])
def test_a_dropped_rank_ends_in_an_error_on_the_others(dist_run, who):
    results = dist_run(3, rank_a_dropped_rank_ends_in_an_error, who)
    outcomes = [outcome for outcome, _ in results]
    if who == "trainer":
        assert outcomes == ["error: RuntimeError", "dropped", "timed out"]
    else:
        assert outcomes[0].startswith("error") and outcomes[ENGINE] == "left"
    assert all(elapsed < 10 * DROP_TIMEOUT_S + 10 for _, elapsed in results)  # bounded, never a hang
