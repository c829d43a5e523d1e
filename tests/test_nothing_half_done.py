"""Nothing half done (issue 50): an interrupted forward, a cast through any module, FSDP2's own calls
and faults at entry leave the masters, FSDP2's state and every rank as before (2 gloo ranks).

Each case failed on 0.12.0: the forward's bf16 casts written into fp32 masters, shards converted on
some ranks only, FSDP2 left SHARDED with UNSHARDED parameters, torch's "mixed Tensor and DTensor"
in place of the caller's own error, in-place ops on a forward's outputs refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from _helpers import (
    LMConfig,
    assert_unchanged,
    build_lm,
    full_state,
    patched,
    shard_lm,
    snapshot,
    tokens_for,
)
from fsdp_shim import _fsdp2

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _oom(message: str) -> BaseException:
    error_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return error_type(message)


class _FailNth(TorchFunctionMode):
    """Raise ``error`` at the ``n``-th call of ``function`` (a ``torch.Tensor`` method) made under it."""

    def __init__(self, function, n: int, error: BaseException) -> None:
        super().__init__()
        self.function, self.n, self.error, self.calls = function, n, error, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is self.function:
            self.calls += 1
            if self.calls == self.n:
                raise self.error
        return func(*args, **(kwargs or {}))


class _Interrupt(nn.Module):
    """Raises ``error`` in forward once armed: a forward cut short inside a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None

    def forward(self, x):
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return x


def _model_with_interrupt(policy=BF16):
    ref, model = build_lm(), build_lm()
    for m in (ref, model):
        m.interrupt = _Interrupt()
        m.blocks[1].fc2.register_forward_hook(lambda mod, args, out, m=m: m.interrupt(out))
    return ref, shard_lm(model, mp_policy=policy)


# ----------------------------------------------------------------------------- an interrupted forward
def rank_an_interrupted_forward_never_reaches_the_masters(error_kind: str):
    _, model = _model_with_interrupt()
    tokens = tokens_for(LMConfig())
    before = snapshot(model)
    error = KeyboardInterrupt("cut short") if error_kind == "interrupt" else RuntimeError("cut short")
    with patched(), FSDP.summon_full_params(model, writeback=True):
        model.interrupt.error = error
        with pytest.raises(type(error)), torch.no_grad():
            model(tokens)
        # the casts are gone at once, not only at exit: state_dict() is the fp32 masters
        assert all(t.dtype == torch.float32 for t in model.state_dict().values())
        assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    assert_unchanged(model, before)  # no edit: the shards bit for bit, FSDP2's state as it was
    with patched(), FSDP.summon_full_params(model, writeback=True):  # an fp32 edit after the interrupt
        model.interrupt.error = error
        with pytest.raises(type(error)), torch.no_grad():
            model(tokens)
        with torch.no_grad():
            model.norm.weight.data.copy_(torch.full_like(model.norm.weight, 1 + 2**-20))
    return full_state(model)["norm.weight"].unique().tolist()


@pytest.mark.parametrize("error_kind", ["interrupt", "exception"])
def test_an_interrupted_forward_never_reaches_the_masters(dist_run, error_kind):
    assert dist_run(2, rank_an_interrupted_forward_never_reaches_the_masters, error_kind) == [[1 + 2**-20]] * 2


def rank_a_fault_part_way_through_the_casts_undoes_them():
    ref, model = _model_with_interrupt()
    tokens = tokens_for(LMConfig())
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=True):
        with pytest.raises(type(_oom(""))), _FailNth(torch.Tensor.to, 3, _oom("out of memory at a cast")):
            with torch.no_grad():
                model(tokens)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        with torch.no_grad():  # the caller's retry succeeds
            out = model(tokens)
    assert_unchanged(model, before)
    with torch.no_grad():
        return torch.equal(out, model(tokens))


def test_a_fault_part_way_through_the_casts_undoes_them(dist_run):
    assert dist_run(2, rank_a_fault_part_way_through_the_casts_undoes_them) == [True, True]


def rank_an_in_place_op_on_an_output_works_and_backward_is_still_refused():
    ref, model = build_lm(), shard_lm(build_lm())
    tokens = tokens_for(LMConfig())
    with patched(), FSDP.summon_full_params(model, writeback=False):
        logits = model(tokens)
        logits.div_(2.0)  # verl scales logits in place
        same = torch.equal(logits, ref(tokens).div(2.0))
        with pytest.raises(RuntimeError, match="computed inside summon_full_params is not supported"):
            logits.sum().backward()
    assert all(p.grad is None for p in model.parameters())
    model(tokens).sum().backward()  # training after: FSDP2's own backward runs
    return same


def test_an_in_place_op_on_an_output_works_and_backward_is_still_refused(dist_run):
    assert dist_run(2, rank_an_in_place_op_on_an_output_works_and_backward_is_still_refused) == [True, True]


# ----------------------------------------------------------------------------- conversions inside
def rank_a_cast_through_part_of_a_unit_is_refused_on_every_rank(rank0_only: bool):
    _, model = build_lm(), shard_lm(build_lm())
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, rank0_only=rank0_only):
            with pytest.raises(RuntimeError, match="a part of an FSDP unit"):
                model.blocks[0].fc1.double()
        assert_unchanged(model, before)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        with FSDP.summon_full_params(model, writeback=False):  # the group still in step
            assert all(p.dtype == torch.float32 for p in model.parameters())
    return True


@pytest.mark.parametrize("rank0_only", [False, True])
def test_a_cast_through_part_of_a_unit_is_refused_on_every_rank(dist_run, rank0_only):
    assert dist_run(2, rank_a_cast_through_part_of_a_unit_is_refused_on_every_rank, rank0_only) == [True, True]


def rank_a_conversion_inside_a_partial_summon_lands_on_every_shard(call: str):
    ref, model = build_lm(), shard_lm(build_lm())
    tokens = tokens_for(LMConfig())
    with patched():
        with FSDP.summon_full_params(model.blocks[0].fc1, writeback=True):  # part of a unit
            getattr(model, call)() if call == "double" else model.to("cpu")
            assert model.blocks[0].fc1.weight.dtype == (torch.float64 if call == "double" else torch.float32)
        if call == "double":
            ref.double()
        assert all(isinstance(p, DTensor) for p in model.parameters())
        got = full_state(model)
        exact = all(torch.equal(got[n], p) for n, p in ref.named_parameters())
        with FSDP.summon_full_params(model, writeback=False):  # a later summon
            again = all(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters(), strict=True))
    if call == "double":  # FSDP2 itself trains on after a conversion only where its policy allows it
        return exact, again, True
    model(tokens.clone()).sum().backward()  # training after
    return exact, again, all(isinstance(p.grad, DTensor) for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("call", ["double", "to_cpu"])
def test_a_conversion_inside_a_partial_summon_lands_on_every_shard(dist_run, call):
    assert dist_run(2, rank_a_conversion_inside_a_partial_summon_lands_on_every_shard, call) == [(True,) * 3] * 2


# ----------------------------------------------------------------------------- FSDP2's own calls inside
def rank_fsdp2s_own_calls_inside_are_refused_on_every_rank(call: str):
    ref, model = build_lm(), shard_lm(build_lm())
    tokens = tokens_for(LMConfig())
    model(tokens)  # initialised, the root left unsharded as FSDP2 leaves it
    model.reshard()
    before = snapshot(model)
    calls = {
        "unshard": lambda: model.blocks[0].unshard(),
        "set_reshard_after_forward": lambda: model.set_reshard_after_forward(False),
        "set_reshard_after_forward_unit": lambda: model.blocks[1].set_reshard_after_forward(True, recurse=False),
    }
    if call.startswith("set_reshard_after_forward") and not hasattr(model, "set_reshard_after_forward"):
        return True  # torch 2.7 has no such call
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            with pytest.raises(RuntimeError, match=r"inside summon_full_params over its parameters"):
                calls[call]()
            assert all(type(p) is nn.Parameter for p in model.parameters())  # the slots kept their full tensors
            with torch.no_grad():
                model.norm.weight.add_(1.0)
                model(tokens)  # a forward inside after the refusal
        assert_unchanged(model, before, values=False)
        ref.norm.weight.data.add_(1.0)
        model.reshard()  # outside the context each call is FSDP2's own again
    loss = model(tokens).sum()  # the next training step
    loss.backward()
    return torch.equal(loss, ref(tokens).sum())


@pytest.mark.parametrize("call", ["unshard", "set_reshard_after_forward", "set_reshard_after_forward_unit"])
def test_fsdp2s_own_calls_inside_are_refused_on_every_rank(dist_run, call):
    assert dist_run(2, rank_fsdp2s_own_calls_inside_are_refused_on_every_rank, call) == [True, True]


def rank_reshard_inside_leaves_the_held_groups_to_the_context(scope: str):
    ref, model = build_lm(), shard_lm(build_lm(), reshard_after_forward=False)
    tokens = tokens_for(LMConfig())
    model(tokens)  # every unit left unsharded
    others = [g for unit in [model, *model.blocks[1:]] for g in _fsdp2.param_groups(_fsdp2.fsdp_state_of(unit))]
    summoned = model if scope == "model" else model.blocks[0]
    with patched():
        with FSDP.summon_full_params(summoned, writeback=True):
            slots = [(name, p) for name, p in summoned.named_parameters()]
            with torch.no_grad():
                next(p for name, p in slots if name.endswith("weight")).add_(1.0)  # an edit, as peft's merge
            for unit in [model, *model.blocks]:  # as peft's merge_adapter() from 0.22: every unit, every rank
                assert unit.reshard() is None
            assert [(name, p) for name, p in summoned.named_parameters()] == slots  # the same full parameters
            assert all(type(p) is nn.Parameter for _, p in slots)
            others_sharded = all(g.is_sharded for g in others)  # FSDP2's own reshard() where no context holds
        name = next(name for name, _ in slots if name.endswith("weight"))
        with torch.no_grad():
            ref.get_submodule("" if scope == "model" else "blocks.0").get_parameter(name).add_(1.0)
    got = full_state(model)
    exact = all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    loss = model(tokens).sum()  # the next training step
    loss.backward()
    return exact, others_sharded or scope == "model", torch.equal(loss, ref(tokens).sum())


def rank_reshard_inside_rank0_only_is_refused_on_every_rank():
    _, model = build_lm(), shard_lm(build_lm())
    tokens = tokens_for(LMConfig())
    model(tokens)
    model.reshard()
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            kept = [p for p in model.parameters()]  # full on rank 0, the live shards elsewhere
            for unit in [model, *model.blocks]:  # peft 0.22's merge would edit the shards on the other ranks
                with pytest.raises(RuntimeError, match=r"summon_full_params\(rank0_only=True\) over its parameters"):
                    unit.reshard()
            assert [p for p in model.parameters()] == kept
        assert_unchanged(model, before)
    return True


def test_reshard_inside_rank0_only_is_refused_on_every_rank(dist_run):
    """Under ``rank0_only`` the other ranks' slots hold the live shards, which what follows a ``reshard()``
    (peft's merge) would edit, or run collectives on through DTensor there alone: refused, as before 0.20."""
    assert dist_run(2, rank_reshard_inside_rank0_only_is_refused_on_every_rank) == [True, True]


@pytest.mark.parametrize("scope", ["model", "block"])
def test_reshard_inside_leaves_the_held_groups_to_the_context(dist_run, scope):
    """peft's merge_adapter() reshards every FSDP2 unit from 0.22 (verl merges inside a summon): ``reshard()`` on a
    group a context holds is done (its shards go back at exit, the edit written back); on any other group it is
    FSDP2's own (a summon of one block leaves the other units' groups to it)."""
    assert dist_run(2, rank_reshard_inside_leaves_the_held_groups_to_the_context, scope) == [(True,) * 3] * 2


# ----------------------------------------------------------------------------- rank0_only forwards
def rank_a_forward_through_a_plain_submodule_under_rank0_only_is_refused_alike():
    _, model = build_lm(), shard_lm(build_lm())
    x = torch.randn(2, LMConfig().width)
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        with pytest.raises(RuntimeError, match="rank0_only=True\\) is not supported"):
            model.blocks[0].fc1(x)
    assert_unchanged(model, before)
    return True


def test_a_forward_through_a_plain_submodule_under_rank0_only_is_refused_alike(dist_run):
    assert dist_run(2, rank_a_forward_through_a_plain_submodule_under_rank0_only_is_refused_alike) == [True, True]


# ----------------------------------------------------------------------------- faults at entry
def rank_a_fault_at_entry_reaches_the_caller_as_itself(where: str):
    _, model = build_lm(), shard_lm(build_lm())
    before = snapshot(model)
    grad_was = torch.is_grad_enabled()
    if where == "shard copy":  # an out-of-memory error while entry keeps the shards' copies
        error, mode = _oom("out of memory keeping a copy"), _FailNth(torch.Tensor.clone, 2, None)
    else:  # an interrupt there, at the first parameter
        error, mode = KeyboardInterrupt("interrupted"), _FailNth(torch.Tensor.clone, 1, None)
    mode.error = error
    with patched():
        with pytest.raises(type(error)) as caught, mode:
            with FSDP.summon_full_params(model, writeback=True):
                pass
    assert caught.value is error, repr(caught.value)
    assert torch.is_grad_enabled() is grad_was
    assert_unchanged(model, before)
    with patched(), FSDP.summon_full_params(model, writeback=False):  # the group reused
        pass
    return mode.calls >= mode.n


@pytest.mark.parametrize("where", ["shard copy", "interrupt"])
def test_a_fault_at_entry_reaches_the_caller_as_itself(dist_run, where):
    assert dist_run(2, rank_a_fault_at_entry_reaches_the_caller_as_itself, where) == [True, True]

