"""``_group``: what a summoned group changes on FSDP2's state and its units, undone exactly by
``release``; and ``ForwardRefusal``, on a real 2-rank FSDP2 model. Then, through
``FSDP.summon_full_params``: forwards inside (``generate``, and those refused), a backward through them
refused, ``state_dict`` and ``load_state_dict`` inside, a conversion other than through a module."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fsdp_shim._versions import parse_version

from _helpers import (
    LMConfig,
    assert_params_equal,
    assert_unchanged,
    full_state,
    patched,
    snapshot,
    tokens_for,
)
from _helpers import reference_and_sharded as _models


def _fsdp2_view(unit: nn.Module, group) -> tuple:
    """What a summon may touch of a unit: its group's state and the unit's hooks and ``_apply``."""
    return (group._sharded_state, group.post_forward_mesh_info, "_apply" in unit.__dict__,
            [(k, v) for k, v in unit._state_dict_pre_hooks.items()],
            [(k, v) for k, v in unit._load_state_dict_pre_hooks.items()],
            [(k, v) for k, v in unit._load_state_dict_post_hooks.items()],
            list(unit._forward_hooks.items()), list(unit._forward_pre_hooks.items()),
            [getattr(p, "_unsharded_param", None) for p in group.fsdp_params])


def rank_summon_then_release_leaves_fsdp2_as_it_was():
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim import _fsdp2 as fsdp2
    from fsdp_shim._group import Conversions, SummonedGroup
    from fsdp_shim._param import SummonedParam, to_full, to_sharded
    from fsdp_shim._scope import collect_scope, sharded_params, slot_owners

    model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    (state,) = [fsdp2.fsdp_state_of(model)]
    (group,) = fsdp2.param_groups(state)
    before = _fsdp2_view(model, group)
    scope = collect_scope(model, True)
    params = [SummonedParam(s, d, None) for s, d in zip(scope.params, sharded_params(scope), strict=True)]
    to_full(params, [p.sharded.full_tensor() for p in params], None, writeback=False)
    conversions = Conversions()
    summoned = SummonedGroup(group, fully_summoned=True)
    summoned.summon(params, holds_fulls=True, forwards=True, roots=lambda: [model])
    conversions.redirect(summoned.units, slot_owners(scope), holds_fulls=True)
    during = _fsdp2_view(model, group)
    model.to(torch.float64)  # through the redirected ``_apply``: the full parameters convert, recorded once
    converted = model[0].weight.dtype == torch.float64 and [m for m, _, _ in conversions.made] == [model]
    summoned.release()
    conversions.release()
    to_sharded(params)
    return during != before, converted, _fsdp2_view(model, group) == before


def test_summon_then_release_leaves_fsdp2_as_it_was(dist_run):
    assert dist_run(2, rank_summon_then_release_leaves_fsdp2_as_it_was) == [(True, True, True)] * 2


def test_a_forward_refusal_refuses_only_its_modules_and_comes_off():
    from fsdp_shim._group import ForwardRefusal

    guarded, free = nn.Linear(2, 2), nn.Linear(2, 2)
    handle = ForwardRefusal([guarded], lambda: "refused here", [])
    handle.install()
    try:
        free(torch.ones(2))
        with pytest.raises(RuntimeError, match="refused here"):
            guarded(torch.ones(2))
    finally:
        handle.remove()
    guarded(torch.ones(2))


def rank_a_registered_forward_method_is_refused_before_fsdp2_gathers(case: str) -> list:
    """FSDP2's ``register_fsdp_forward_method`` calls the state's ``_pre_forward`` itself, past ``_call_impl``:
    the summon's refusals held only for ``_call_impl``, so under ``rank0_only`` the ranks that hold no full
    tensors all-gathered the root's group alone (the unit's parameters replaced on rank 1, FSDP2's state
    changed on rank 0), and a summon of part of a unit let the method all-gather over the summoned slot."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    from fsdp_shim import _fsdp2 as fsdp2

    reference, model = _models()
    config = LMConfig()
    tokens, x = tokens_for(config), torch.randn(2, 8, config.width)
    model(tokens)  # FSDP2's lazy init
    model.reshard()  # the root (2.7 leaves it unsharded after a forward; a summon reshards it: see the README)
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(model.blocks[0], "ffn")
    before = snapshot(model)
    said = []
    with patched():
        if case == "whole":  # every rank holds every full parameter: the method runs on them, as FSDP1's would
            with FSDP.summon_full_params(model, writeback=False):
                said.append(torch.equal(model.generate(tokens, 2), reference.generate(tokens, 2)))
        else:
            with pytest.raises(RuntimeError, match="is not supported") as refused:
                if case == "rank0_only":
                    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
                        model.generate(tokens, 2)
                else:  # part of a unit, an edit inside: written back although the body raised, as FSDP1 does
                    with FSDP.summon_full_params(model.blocks[0].fc1, writeback=True):
                        with torch.no_grad():
                            model.blocks[0].fc1.weight.add_(1.0)
                        model.blocks[0].ffn(x)
            said.append(str(refused.value).split(":")[0])
    if case == "part_of_a_unit":
        with torch.no_grad():
            reference.blocks[0].fc1.weight.add_(1.0)
    assert_unchanged(model, before, values=case != "part_of_a_unit")
    full = full_state(model)
    assert all(torch.equal(full[name], value) for name, value in reference.named_parameters())
    assert not [s for s in fsdp2.all_fsdp_states() if "_pre_forward" in s.__dict__], "a guard outlived its context"
    assert torch.equal(model(tokens), reference(tokens))  # and FSDP2 gathers on
    return said


@pytest.mark.parametrize("case", ["whole", "rank0_only", "part_of_a_unit"])
def test_a_registered_forward_method_is_refused_before_fsdp2_gathers(dist_run, case):
    said = dist_run(2, rank_a_registered_forward_method_is_refused_before_fsdp2_gathers, case, timeout_s=60)
    assert said[0] == said[1] == {
        "whole": [True],
        "rank0_only": ["forward inside summon_full_params(FSDPTinyLM, rank0_only=True) is not supported"],
        "part_of_a_unit": ["forward through FSDP unit FSDPBlock while only some of its parameters are summoned is "
                           "not supported"],
    }[case]


def rank_a_registered_forward_method_on_a_held_unit_runs_as_a_forward(mixed: bool) -> list:
    """A method registered with ``register_fsdp_forward_method`` on a unit the context holds (``generate`` on
    the root, ``ffn`` on a block) runs as a forward through ``_call_impl`` does: in FSDP2's ``param_dtype`` on
    the summoned values (an edit inside included), and the unit's slots keep the full parameters (FSDP2's own
    outer post-forward, run after the inner forward left the group idle, resharded them: a ``writeback`` exit
    then raised and the edit was lost, and under a policy the method ran on a stale cast)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else None
    reference, model = _models(mp_policy=policy)
    config = LMConfig()
    tokens, x = tokens_for(config), torch.randn(2, 8, config.width)
    model(tokens)
    model.reshard()
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(model.blocks[0], "ffn")
    with torch.no_grad():
        ffn_before = model.blocks[0].ffn(x)  # FSDP2's own, outside any context
    generated_before = model.generate(tokens, 3)
    said = []
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            said.append(torch.equal(model.generate(tokens, 3), generated_before))
            said.append(not any(isinstance(p, DTensor) for p in model.parameters()))
            model(tokens)  # an ordinary forward between: the next method must not see its casts
            with torch.no_grad():
                said.append(torch.equal(model.blocks[0].ffn(x), ffn_before))
                model.blocks[0].fc1.weight.add_(0.5)  # an edit: the methods after it and the writeback see it
                model.embed.weight.mul_(1.5)
                reference.blocks[0].fc1.weight.add_(0.5)
                reference.embed.weight.mul_(1.5)
                ffn_edited = model.blocks[0].ffn(x)
            generated_edited = model.generate(tokens, 3)
            said.append(not any(isinstance(p, DTensor) for p in model.parameters()))
    full = full_state(model)
    said.append(all(torch.equal(full[name], value) for name, value in reference.named_parameters()))
    with torch.no_grad():
        said.append(torch.equal(model.blocks[0].ffn(x), ffn_edited))  # FSDP2's own again, on the edited shards
    said.append(torch.equal(model.generate(tokens, 3), generated_edited))
    if not mixed:
        said.append(torch.equal(generated_edited, reference.generate(tokens, 3)))
    return said


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-policy"])
def test_a_registered_forward_method_on_a_held_unit_runs_as_a_forward(dist_run, mixed):
    said = dist_run(2, rank_a_registered_forward_method_on_a_held_unit_runs_as_a_forward, mixed, timeout_s=90)
    assert said[0] == said[1] == [True] * (7 if mixed else 8)


def _left_behind(model: nn.Module) -> list:
    """What a context changed on FSDP2's objects and the units' instances that exit did not put back."""
    from fsdp_shim import _fsdp2 as fsdp2

    left = [(name, type(state).__name__) for state in fsdp2.all_fsdp_states() for group in fsdp2.param_groups(state)
            for name in ("_to_sharded", "pre_forward", "post_forward") if name in group.__dict__]
    left += [("_pre_forward", "FSDPState") for state in fsdp2.all_fsdp_states() if "_pre_forward" in state.__dict__]
    left += [(name, type(m).__name__) for m in model.modules() for name in ("_call_impl", "_apply") if name in m.__dict__]
    return left + [(name, type(m).__name__) for m in model.modules() for name, value in m.__dict__.items()
                   if getattr(getattr(value, "__code__", None), "co_name", None) == "forward_method"]  # the shim's


def rank_a_grouped_unit_runs_its_forwards_inside_in_param_dtype() -> list:
    """``fully_shard([b0, b1])`` under a bf16 policy: every forward inside runs on casts, one that skips ``b1``
    included (FSDP2 then finishes the group from the root: its group pre- and post-forward do not come in pairs,
    so a cast counted there went wrong from that forward on; on 2.7 the group's pre-forward runs for ``b0`` alone)."""
    from torch.distributed.fsdp import fully_shard

    class Grouped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b0, self.b1, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
            x = self.b0(x)
            return self.head(x if skip else self.b1(x))

    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = Grouped()
    fully_shard([model.b0, model.b1], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x = torch.randn(4, 8)
    skips = (False, True, False, False)
    if parse_version(torch.__version__)[:2] < (2, 8):  # 2.7's FSDP2 never finishes a group whose module is skipped
        skips = (False, False, False, False)
    with torch.no_grad():
        want, want_skip = model(x), model(x, skip=True) if True in skips else None  # FSDP2's own
    said = []
    with patched(), FSDP.summon_full_params(model, writeback=True), torch.no_grad():
        for skip in skips:
            said.append(torch.equal(model(x, skip=skip), want_skip if skip else want))
        said.append(model.b0.weight.dtype == model.b1.weight.dtype == torch.float32)
    said.append(_left_behind(model) == [])
    with torch.no_grad():
        said.append(torch.equal(model(x), want))
    return said


def test_a_grouped_unit_runs_its_forwards_inside_in_param_dtype(dist_run):
    assert dist_run(2, rank_a_grouped_unit_runs_its_forwards_inside_in_param_dtype) == [[True] * 7] * 2


def rank_a_registered_method_that_raises_inside_leaves_nothing_behind(error: type) -> list:
    """A forward method on a held unit that raises after its nested forward (an ``Exception`` or a
    ``KeyboardInterrupt``), under a bf16 policy: its casts are put back at once, so an edit after it reaches the
    full parameter (it reached a cast, discarded at exit) and the next forward computes on it."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    (_, own), (_, model) = _models(mp_policy=policy), _models(mp_policy=policy)  # ``own``: FSDP2's, never summoned
    tokens = tokens_for(LMConfig())
    model(tokens)
    model.reshard()

    def boom(t: torch.Tensor) -> None:
        model(t)
        raise error("boom")

    model.boom = boom
    register_fsdp_forward_method(model, "boom")
    with torch.no_grad():
        own.embed.weight.mul_(1.5)
        want = own(tokens)
    said = []
    with patched(), FSDP.summon_full_params(model, writeback=True):
        with pytest.raises(error, match="boom"):
            model.boom(tokens)
        said.append(model.embed.weight.dtype == torch.float32)
        with torch.no_grad():
            model.embed.weight.mul_(1.5)
            said.append(torch.equal(model(tokens), want))
    own.reshard()  # 2.7 leaves the root unsharded after a forward, in ``param_dtype``
    said.append(torch.equal(full_state(model)["embed.weight"], full_state(own)["embed.weight"]))
    said.append(_left_behind(model) == [])
    with torch.no_grad():
        said.append(torch.equal(model(tokens), own(tokens)))
    return said


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt], ids=["exception", "keyboard_interrupt"])
def test_a_registered_method_that_raises_inside_leaves_nothing_behind(dist_run, error):
    assert dist_run(2, rank_a_registered_method_that_raises_inside_leaves_nothing_behind, error) == [[True] * 5] * 2


def rank_a_backward_through_a_registered_method_inside_is_refused() -> tuple:
    """A backward through the output of a forward method on a held unit (a block's ``ffn`` branch, before any
    forward) is refused as one through the unit's own call is: FSDP2's post-backward would reduce-scatter
    gradients of the summoned parameters into the shards' ``.grad``. (Registered as ``branch``: ``forward`` calls
    ``ffn``, and FSDP2 2.7's own backward fails through a registered method nested in a forward.)"""
    from torch.distributed.fsdp import register_fsdp_forward_method

    reference, model = _models()
    config = LMConfig()
    model.blocks[0].branch = model.blocks[0].ffn
    register_fsdp_forward_method(model.blocks[0], "branch")
    x, tokens = torch.randn(2, 8, config.width), tokens_for(config)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        out = model.blocks[0].branch(x)
        with pytest.raises(RuntimeError, match="backward through outputs of FSDP unit FSDPBlock") as refused:
            out.sum().backward()
    grads = [name for name, p in model.named_parameters() if p.grad is not None]
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for m, o in ((model, optimizer), (reference, reference_optimizer)):
        m(tokens).pow(2).mean().backward()
        o.step()
    full = full_state(model)
    exact = all(torch.equal(full[name], value) for name, value in reference.named_parameters())
    return "not supported" in str(refused.value), grads, _left_behind(model), exact


def test_a_backward_through_a_registered_method_inside_is_refused(dist_run):
    assert dist_run(2, rank_a_backward_through_a_registered_method_inside_is_refused) == [(True, [], [], True)] * 2


def rank_a_held_units_methods_are_theirs_again_after_exit(case: str) -> list:
    """What the context does to a held unit's forward methods ends with it: a bound method over a callable
    without code in its dict is left alone (it broke every summon of the unit), the user's assignment or deletion
    of a registered method inside stands, and an interrupt while the wrapper puts its casts back (bf16) is
    finished there: an edit after it reaches the full parameter and is written back exactly (it went into a cast
    and exit wrote back rounded values)."""
    import functools
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    from fsdp_shim import _param

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case == "interrupted_put_back" else None
    (_, own), (_, model) = _models(mp_policy=policy), _models(mp_policy=policy)
    config = LMConfig()
    tokens, x = tokens_for(config), torch.randn(2, 8, config.width)
    block = model.blocks[0]
    block.branch = block.ffn
    register_fsdp_forward_method(block, "branch")
    register_fsdp_forward_method(model, "generate")
    block.scaled = types.MethodType(functools.partial(lambda factor, self, t: factor * t, 2.0), block)
    registered = model.__dict__["generate"]
    said = []
    with patched(), FSDP.summon_full_params(model, writeback=True):
        said.append(torch.equal(block.scaled(x), 2.0 * x))
        if case == "reassigned":
            model.generate = "theirs"
        elif case == "deleted":
            del model.generate
        elif case == "interrupted_put_back":
            put_back, calls = _param.SummonedParam.put_back, []

            def interrupted(self, held):  # the first put-back raises before it places anything
                calls.append(1)
                if len(calls) == 1:
                    raise KeyboardInterrupt("while the casts are put back")
                return put_back(self, held)

            _param.SummonedParam.put_back = interrupted
            try:
                with pytest.raises(KeyboardInterrupt):
                    block.branch(x)
            finally:
                _param.SummonedParam.put_back = put_back
            said.append(block.fc1.weight.dtype == torch.float32)
            with torch.no_grad():
                block.fc1.weight.add_(0.25)
                own.blocks[0].fc1.weight.add_(0.25)
    said.append({"reassigned": model.__dict__.get("generate") == "theirs",
                 "deleted": "generate" not in model.__dict__,
                 "untouched": model.__dict__.get("generate") is registered,
                 "interrupted_put_back": torch.equal(full_state(model)["blocks.0.fc1.weight"],
                                                     full_state(own)["blocks.0.fc1.weight"])}[case])
    said.append(_left_behind(model) == [])
    return said


@pytest.mark.parametrize("case", ["untouched", "reassigned", "deleted", "interrupted_put_back"])
def test_a_held_units_methods_are_theirs_again_after_exit(dist_run, case):
    want = [True] * (4 if case == "interrupted_put_back" else 3)
    assert dist_run(2, rank_a_held_units_methods_are_theirs_again_after_exit, case) == [want] * 2


def rank_forward_refusals_nest_and_put_back_what_they_found() -> bool:
    """Two refusals sharing a unit's state, removed in either order, and a ``_pre_forward`` someone else set on
    the state's instance: each refusal speaks while it lives, and what was there before comes back."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim import _fsdp2 as fsdp2
    from fsdp_shim._group import ForwardRefusal

    unit = fully_shard(nn.Linear(4, 4))
    state = fsdp2.fsdp_state_of(unit)
    theirs = state._pre_forward  # bound: FSDP2's own, as an object of its own
    for order in ("inner first", "outer first"):
        state.__dict__["_pre_forward"] = theirs
        outer = ForwardRefusal([unit], lambda: "outer", [state])
        outer.install()
        inner = ForwardRefusal([unit], lambda: "inner", [state, state])  # listed twice: guarded once
        inner.install()
        with pytest.raises(RuntimeError, match="outer"):
            state._pre_forward(unit, (torch.ones(4),), {})
        first, second = (inner, outer) if order == "inner first" else (outer, inner)
        first.remove()
        with pytest.raises(RuntimeError, match="inner" if first is outer else "outer"):
            state._pre_forward(unit, (torch.ones(4),), {})
        second.remove()
        assert state.__dict__["_pre_forward"] is theirs, order
    del state.__dict__["_pre_forward"]
    refusal = ForwardRefusal([unit], lambda: "refused", [state])
    refusal.install()
    refusal.remove()
    refusal.remove()  # twice: nothing more
    return "_pre_forward" not in state.__dict__ and unit(torch.ones(2, 4)).shape == (2, 4)


def test_forward_refusals_nest_and_put_back_what_they_found(dist_run):
    assert dist_run(2, rank_forward_refusals_nest_and_put_back_what_they_found) == [True, True]


def rank_hook_sites_are_kept_only_once_fsdp2_registered_them():
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim import _fsdp2 as fsdp2

    model = fully_shard(nn.Linear(4, 4))
    (group,) = fsdp2.param_groups(fsdp2.fsdp_state_of(model))
    before_init = len(fsdp2.group_hook_sites(group))  # load post-hooks only: FSDP2 has not initialised
    kept_before = "_fsdp_shim_hook_sites" in group.__dict__
    model(torch.ones(1, 4))  # FSDP2's lazy init registers the group's state-dict hooks
    after_init = len(fsdp2.group_hook_sites(group))
    return before_init, kept_before, after_init, "_fsdp_shim_hook_sites" in group.__dict__


def test_hook_sites_are_kept_only_once_fsdp2_registered_them(dist_run):
    # two parameters' load post-hooks; then the module's state-dict save and load pre-hooks too
    assert dist_run(2, rank_hook_sites_are_kept_only_once_fsdp2_registered_them) == [(2, False, 4, True)] * 2


def rank_a_conversion_other_than_through_a_module_warns():
    _, model = _models()
    before = snapshot(model)
    with patched(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with FSDP.summon_full_params(model, writeback=False):
            fc1 = model.blocks[0].fc1
            fc1.weight.data = fc1.weight.data.double()  # no module's .to(): the shard cannot follow
    assert_unchanged(model, before)
    return [str(w.message) for w in record if "was converted to torch.float64" in str(w.message)]


def test_a_conversion_other_than_through_a_module_warns(dist_run):
    (message,), others = dist_run(2, rank_a_conversion_other_than_through_a_module_warns)  # once, on rank 0
    assert others == [] and message.startswith("blocks.0.fc1.weight was converted to torch.float64")


def rank_forward_inside_context(mixed: bool, first_forward_inside: bool):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else None
    ref, model = _models(mp_policy=mp)
    tokens = tokens_for(LMConfig())
    if not first_forward_inside:
        model(tokens)  # leaves the root unsharded
    expected = None
    if mixed:  # FSDP2's own numerics, no context
        expected = _models(mp_policy=mp)[1].generate(tokens, 4)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, recurse=False):
            got = model.generate(tokens, 4)
            assert model.embed.weight.dtype == torch.float32
            assert not isinstance(model.embed.weight, DTensor)
            assert torch.equal(model.embed.weight, ref.embed.weight)
        with FSDP.summon_full_params(model, writeback=False):
            got_all = model.generate(tokens, 4)
            assert_params_equal(model, ref)
    want = expected if mixed else ref.generate(tokens, 4)
    assert torch.equal(got, want) and torch.equal(got_all, want)
    # training continues and matches the reference
    if not mixed:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            for m, o in ((model, opt), (ref, ref_opt)):
                m(tokens).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        got = full_state(model)
        for name, value in ref.named_parameters():
            assert torch.equal(got[name], value), name


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-policy"])
@pytest.mark.parametrize("first_forward_inside", [False, True], ids=["after-forward", "first-forward-inside"])
def test_generate_inside_context_matches_reference(dist_run, mixed, first_forward_inside):
    dist_run(2, rank_forward_inside_context, mixed, first_forward_inside)


def rank_state_dict_hooks_and_repeated_use():
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    with patched():
        for _ in range(3):
            model(tokens)
            with FSDP.summon_full_params(model, writeback=False):
                sd = model.state_dict()
                assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
        sd = model.state_dict()  # outside: FSDP2's sharded state dict again
        assert all(isinstance(v, DTensor) for v in sd.values())


def test_state_dict_inside_is_full_and_outside_sharded(dist_run):
    dist_run(2, rank_state_dict_hooks_and_repeated_use)


def rank_unsupported_forwards_raise_on_every_rank():
    _, model = _models()
    tokens = tokens_for(LMConfig())
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            with pytest.raises(RuntimeError, match="rank0_only=True"):
                model(tokens)
        with FSDP.summon_full_params(model.blocks[0].fc1, writeback=False):
            with pytest.raises(RuntimeError, match="only some of its parameters"):
                model(tokens)  # refused before the root's pre-forward: FSDP2 state untouched
            with pytest.raises(RuntimeError, match="only some of its parameters"):
                model.blocks[0](torch.randn(2, 8, LMConfig().width))
            assert isinstance(model.blocks[0].fc2.weight, DTensor)
            assert not isinstance(model.blocks[0].fc1.weight, DTensor)
    assert_unchanged(model, before)
    model(tokens)  # FSDP2 still works


def rank_backward_through_a_summoned_unit_raises_clearly():
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, recurse=False):
            loss = model(tokens).sum()
            with pytest.raises(RuntimeError, match="backward through outputs of FSDP unit FSDPTinyLM"):
                loss.backward()
        with torch.no_grad():
            assert torch.equal(model(tokens), ref(tokens))  # forward inside built no state
    model.reshard()
    assert_unchanged(model, before)
    for m in (model, ref):
        m(tokens).sum().backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert all(torch.equal(got[n], p.grad) for n, p in ref.named_parameters())


def test_backward_through_a_summoned_unit_raises_clearly(dist_run):
    dist_run(2, rank_backward_through_a_summoned_unit_raises_clearly)


def test_forwards_that_would_desynchronise_ranks_raise(dist_run):
    dist_run(2, rank_unsupported_forwards_raise_on_every_rank)


def rank_load_state_dict_inside_loads_full_weights(forward_first: bool):
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    if forward_first:  # FSDP2 registers its state-dict hooks at lazy init
        model(tokens)
        model.reshard()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(-1.5)
    target = {k: v.clone() for k, v in ref.state_dict().items()}
    sharded = {n: p for n, p in model.named_parameters()}
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=True):
        model.load_state_dict(target)  # full tensors into full parameters
        assert_params_equal(model, ref)
    assert_unchanged(model, before, values=False)
    assert all(p is sharded[n] for n, p in model.named_parameters())
    got = full_state(model)
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    assert torch.equal(model(tokens), ref(tokens))  # FSDP2 adopted nothing it should not have


@pytest.mark.parametrize("forward_first", [False, True])
def test_load_state_dict_inside_writes_a_full_checkpoint_into_shards(dist_run, forward_first):
    dist_run(2, rank_load_state_dict_inside_loads_full_weights, forward_first)
