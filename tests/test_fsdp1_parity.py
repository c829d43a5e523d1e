"""Side by side with FSDP1's own summon_full_params on the same architecture."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from _helpers import LMConfig, build_lm, patched, rank, shard_lm, tokens_for
from fsdp_shim.tools.models import wrap_lm_fsdp1

CASES = [
    dict(recurse=True, writeback=False),
    dict(recurse=False, writeback=False),
    dict(recurse=True, writeback=False, rank0_only=True),
    # FSDP1's own offload_to_cpu=True kills its ranks when the FSDP1 device is
    # the CPU (torch 2.13, gloo): not comparable here; test_summon covers ours.
    dict(recurse=True, writeback=False, with_grads=True),
]
MISUSE = [
    dict(writeback=True, rank0_only=True),
    dict(with_grads=True, offload_to_cpu=True),
]


def _fsdp1():
    return wrap_lm_fsdp1(build_lm(), torch.device("cpu"))


def _seen(model, kwargs):
    """What a caller sees inside the context: {name: (full tensor or None if still sharded, grad, device)}.

    Every parameter, 1-D ones included. FSDP1's sharded views are flat, so a
    parameter is full there when it has its full shape; a 1-D parameter that
    sits whole in this rank's flat shard looks full even unsummoned, which
    ``_judge`` allows for.
    """
    reference = dict(build_lm().named_parameters())
    out = {}
    with FSDP.summon_full_params(model, **kwargs):
        for name, p in model.named_parameters():
            name = name.replace("_fsdp_wrapped_module.", "")
            full = not isinstance(p, DTensor) and p.shape == reference[name].shape
            grad = None if p.grad is None else p.grad.detach().clone()
            out[name] = (p.detach().clone() if full else None, grad if full else None, p.device.type)
    return out


def _expected_full(kwargs) -> set[str]:
    """The parameters FSDP1's contract makes full on this rank: the root's own without ``recurse``."""
    if kwargs.get("rank0_only") and rank() != 0:
        return set()
    names = {n for n, _ in build_lm().named_parameters()}
    return names if kwargs.get("recurse", True) else {n for n in names if not n.startswith("blocks.")}


def _judge(kwargs, one, two) -> None:
    """FSDP2 through the shim shows exactly what FSDP1's contract says, with FSDP1's values."""
    full_two = {k for k, v in two.items() if v[0] is not None}
    assert full_two == _expected_full(kwargs), (kwargs, full_two ^ _expected_full(kwargs))
    full_one = {k for k, v in one.items() if v[0] is not None}
    matrices = {k for k in one if one[k][0] is None or one[k][0].ndim >= 2}  # a 1-D one may look full: see _seen
    assert full_one & matrices == full_two & matrices, (kwargs, (full_one ^ full_two) & matrices)
    assert full_two <= full_one, (kwargs, full_two - full_one)
    for name in full_two:
        assert torch.equal(one[name][0], two[name][0]), (kwargs, name)
        assert one[name][2] == two[name][2], (kwargs, name)
        if kwargs.get("with_grads"):
            torch.testing.assert_close(one[name][1], two[name][1], rtol=0, atol=1e-6)


def rank_same_view_as_fsdp1():
    tokens = tokens_for(LMConfig())
    with patched():
        fsdp1, fsdp2 = _fsdp1(), shard_lm(build_lm())
        for model in (fsdp1, fsdp2):
            model(tokens).sum().backward()
        for kwargs in CASES:
            one = _seen(fsdp1, kwargs)
            two = _seen(fsdp2, kwargs)
            _judge(kwargs, one, two)
        for kwargs in MISUSE:
            errors = []
            for model in (fsdp1, fsdp2):
                with pytest.raises(Exception) as info:
                    with FSDP.summon_full_params(model, **kwargs):
                        pass
                errors.append(type(info.value))
            assert errors[0] is errors[1] is NotImplementedError, (kwargs, errors)


def test_every_argument_combination_matches_fsdp1(dist_run):
    dist_run(2, rank_same_view_as_fsdp1)


def rank_writeback_matches_fsdp1():
    with patched():
        results = []
        for model in (_fsdp1(), shard_lm(build_lm())):
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "fc1" in name or "embed" in name:
                            p.mul_(3.0)
            with FSDP.summon_full_params(model, writeback=False):
                results.append({n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                                for n, p in model.named_parameters()})
        assert results[0].keys() == results[1].keys()
        for name in results[0]:
            assert torch.equal(results[0][name], results[1][name]), name


def test_writeback_matches_fsdp1(dist_run):
    dist_run(2, rank_writeback_matches_fsdp1)


def rank_unit_discovery_treats_fsdp1_and_fsdp2_alike():
    import fsdp_shim

    fsdp1, fsdp2 = _fsdp1(), shard_lm(build_lm())
    assert [n for n, _ in fsdp_shim.fsdp_units(fsdp1)] == ["", "blocks.0", "blocks.1"]
    assert [n for n, _ in fsdp_shim.fsdp_units(fsdp2)] == ["", "blocks.0", "blocks.1"]
    assert fsdp_shim.is_fsdp_module(fsdp2.blocks[0]) and fsdp_shim.is_fsdp_module(fsdp1)
    assert not fsdp_shim.is_fsdp_module(fsdp2.blocks[0].fc1)
    with patched():
        assert not isinstance(fsdp2, FSDP)  # FSDP1 code paths must not take FSDP2 modules
    with patched(), FSDP.summon_full_params(fsdp1, writeback=False):
        name, param = next(iter(fsdp1.named_parameters()))
        assert fsdp_shim.param_fqn(fsdp1, param) == "embed.weight"


def test_unit_discovery_treats_fsdp1_and_fsdp2_alike(dist_run):
    dist_run(2, rank_unit_discovery_treats_fsdp1_and_fsdp2_alike)
