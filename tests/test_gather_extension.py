"""Tensor subclasses with FSDP2's all-gather extension: quantized storage refused, cast wrappers served.

QLoRA keeps its frozen base weights as torchao ``NF4Tensor``s under
``fully_shard``; FSDP2 gathers them through ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``. A plain all-gather of their local tensor fails
inside torchao with a message that names no parameter. The summon and the
stream refuse them in their shared words (``_refusals.gather_extension``),
naming the parameter and the subclass, on every rank, before any
collective, leaving everything as it was (issue 50, item 7).

torchao's float8 training weights (``WeightWithDynamicFloat8CastTensor``, what
``convert_to_float8_training`` puts on a Linear's weight before ``fully_shard``)
define the extension too, but only to send float8 bytes in training: each wraps
its plain fp32 master. The summon and the stream serve that master, exact, as
0.12.0 did, and a writeback lands in it, the shard keeping its subclass
(issue 58, item 1). Each test compares with an unsharded model built from the
same seed: exactly, but for a training step's float8 matmuls (closely). They
need torchao (the README's test command installs 0.18.0) and skip without it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import fsdp_shim
from _helpers import counting_collectives, mesh1d, patched, rank
from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim._versions import parse_version


def _state(model: nn.Module) -> list[object]:
    """Every slot's object and local bits (an NF4 shard's inner tensors: torchao has no ``equal``),
    and every FSDP2 group's states."""
    out: list[object] = []
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        inner = [local.quantized_data, local.quantized_scalers] if hasattr(local, "quantized_data") else [local]
        out.append((name, id(p), [t.detach().clone().view(torch.uint8).tolist() for t in inner]))
    for module in model.modules():
        state = fsdp2.fsdp_state_of(module)
        for group in fsdp2.param_groups(state) if state is not None else []:
            out.append((group._sharded_state, group._training_state))
    return out


def _qlora_block() -> nn.Module:
    from torchao.quantization import to_nf4  # noqa: PLC0415  # only where torchao imports (0.18: here)

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 512, bias=False), nn.Linear(512, 64))
    base = block[0]
    base.weight = nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)  # QLoRA's frozen base
    return block


def rank_nf4_base_weights_are_refused_by_name_before_any_collective():
    model = nn.Sequential(_qlora_block())
    fully_shard(model[0], mesh=mesh1d())
    fully_shard(model, mesh=mesh1d())
    local = model[0][0].weight._local_tensor
    assert isinstance(model[0][0].weight, DTensor) and hasattr(local, "fsdp_pre_all_gather"), type(local)
    before = _state(model)
    with patched(), counting_collectives() as counts:
        for call in (
            lambda: FSDP.summon_full_params(model, writeback=False),
            lambda: FSDP.summon_full_params(model[0], recurse=False, writeback=True),
            lambda: FSDP.summon_full_params(model[0], recurse=False, writeback=False, rank0_only=True),
        ):
            with pytest.raises(NotImplementedError, match=r"'0\.0\.weight'|'0\.weight'") as refused:
                with call():
                    raise AssertionError("the body ran")
            assert type(local).__name__ in str(refused.value) and "all-gather extension" in str(refused.value)
        with pytest.raises(NotImplementedError, match=r"'0\.0\.weight'.*NF4Tensor"):
            next(iter(fsdp_shim.iter_full_params(model)))
    assert counts == {}, counts
    assert _state(model) == before, "a slot, a shard or FSDP2's state changed"
    # the units around it still summon: the plain Linear's parameters
    with patched(), FSDP.summon_full_params(model[0][1], writeback=False):
        assert not isinstance(model[0][1].weight, DTensor)


def test_nf4_base_weights_are_refused_by_name_before_any_collective(dist_run):
    pytest.importorskip("torchao.quantization", exc_type=ImportError)
    dist_run(2, rank_nf4_base_weights_are_refused_by_name_before_any_collective)


# --------------------------------------------------------------------------- float8 training weights: served
#: torchao 0.18's own floor (its ``__init__`` loads its kernels from torch 2.11 on): below it, ``import torchao``
#: may fail otherwise than with an ``ImportError`` (an ``AttributeError`` for a torch API it names).
_TORCHAO_FLOOR = (2, 11)


def _need_torchao_float8() -> None:
    """Skip, in the test process (a skip inside a rank reads as an error), where torchao's float8 is not
    installed, or does not import on a torch below torchao 0.18's floor; on a newer torch an import that
    fails otherwise is an error (the README's test command installs torchao 0.18.0)."""
    if parse_version(torch.__version__)[:2] < _TORCHAO_FLOOR:
        try:
            import torchao.float8  # noqa: F401, PLC0415  # whether it imports here at all
        except Exception as error:  # noqa: BLE001  # any failure to import on an older torch is a skip
            pytest.skip(f"torchao does not import on torch {torch.__version__} ({error!r})")
    pytest.importorskip("torchao.float8", exc_type=ImportError)


def _plain(first_bias: bool = False, rows: int = 33) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=first_bias), nn.ReLU(), nn.Linear(128, 48), nn.Linear(48, rows))


def _to_float8(model: nn.Module) -> nn.Module:
    """``model`` for float8 training, torchtitan's way: each Linear's weight a float8 cast wrapper of itself."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415  # only where torchao imports

    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def _float8_models(*, first_bias: bool = False, dim1: bool = False, rows: int = 33) -> tuple[nn.Module, nn.Module]:
    """A float8-training model sharded torchtitan's way (``_to_float8``, then ``fully_shard`` per Linear and
    the root), and the plain model it was built from (the same seed).

    Its units take each path of the gather: a bucket of one sent as it is (``0``, without ``first_bias``),
    shards copied in back to back (``2``: 48 rows) and padded ones (``3``: ``rows``, 33 over two ranks);
    ``dim1``: weights sharded on dim 1, which only ``full_tensor()`` gathers (the engine's fallback).
    """
    reference, model = _plain(first_bias, rows), _to_float8(_plain(first_bias, rows))
    placement = (lambda p: Shard(1) if p.ndim == 2 else Shard(0)) if dim1 else None
    for unit in (model[0], model[2], model[3]):
        fully_shard(unit, mesh=mesh1d(), shard_placement_fn=placement)
    fully_shard(model, mesh=mesh1d())
    for linear in (model[0], model[2], model[3]):
        assert type(linear.weight._local_tensor) is _wrapper_type(), type(linear.weight._local_tensor)
    return model, reference


def _wrapper_type() -> type:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: PLC0415  # as above

    return WeightWithDynamicFloat8CastTensor


def _shard_of(param: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` under ``param``'s one ``Shard`` placement, as FSDP2 chunks it."""
    (placement,) = param.placements
    return torch.chunk(full, 2, dim=placement.dim)[rank()]


def _check_summoned(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    """Inside a summon on every rank: each parameter a plain fp32 ``nn.Parameter``, equal to ``want``'s."""
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and p.dtype == torch.float32, (name, type(p), p.dtype)
        assert torch.equal(p.detach(), want[name].detach()), f"{name} differs"


def rank_float8_weights_summon_as_their_exact_masters():
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415  # as above

    model, reference = _float8_models()
    want = dict(reference.named_parameters())
    inputs = torch.randn(8, 64)
    with patched():
        with FSDP.summon_full_params(model, writeback=False):
            _check_summoned(model, want)
            with torch.no_grad():  # a forward inside: the unsharded float8 model's, exactly
                assert torch.equal(model(inputs), _to_float8(_plain())(inputs))
        for prefix in ("0", "2", "3"):
            unit = model.get_submodule(prefix)
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                for name, p in unit.named_parameters():
                    if rank() == 0:
                        assert type(p) is nn.Parameter, (name, type(p))
                        assert torch.equal(p.detach(), want[f"{prefix}.{name}"].detach()), f"{prefix}.{name} differs"
                    else:
                        assert isinstance(p, DTensor), (name, type(p))
        precompute_float8_dynamic_scale_for_fsdp(model)  # torchtitan's option: each shard holds its scale too
        assert "_precomputed_scale" in model[0].weight._local_tensor.__tensor_flatten__()[0]
        with FSDP.summon_full_params(model, writeback=False):
            _check_summoned(model, want)
    for name, p in model.named_parameters():  # nothing was written
        assert torch.equal(p.to_local().detach(), _shard_of(p, want[name].detach())), name


def test_float8_weights_summon_as_their_exact_masters(dist_run):
    _need_torchao_float8()
    dist_run(2, rank_float8_weights_summon_as_their_exact_masters)


def rank_float8_writeback_lands_in_the_master_and_keeps_the_subclass(dim1: bool):
    model, reference = _float8_models(dim1=dim1)
    fsdp2.fsdp_state_of(model)._lazy_init()  # FSDP2's own lazy init re-slices padded shards: done first
    before = [(name, p, p._local_tensor, getattr(p._local_tensor, "_tensor", None))
              for name, p in model.named_parameters()]
    with torch.no_grad():
        reference[0].weight[::3].zero_()
        reference[3].weight[5:20].fill_(0.5)
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model[0].weight[::3].zero_()  # in every rank's shard
                model[3].weight[5:20].fill_(0.5)  # on dim 0, across the padded shards' boundary (17 | 16 rows)
        want = dict(reference.named_parameters())
        for (name, p, local, master), (now_name, now) in zip(before, model.named_parameters(), strict=True):
            assert now_name == name and now is p, f"{name}: parameter object replaced"
            assert p._local_tensor is local and getattr(local, "_tensor", None) is master, f"{name}: shard replaced"
            if name.endswith("weight"):
                assert type(p._local_tensor) is _wrapper_type(), (name, type(p._local_tensor))
            assert torch.equal(p.to_local().detach(), _shard_of(p, want[name].detach())), f"{name}: shard differs"
        with FSDP.summon_full_params(model, writeback=False):  # a second summon sees the edit
            _check_summoned(model, want)


@pytest.mark.parametrize("dim1", [False, True], ids=["dim0", "dim1-fallback"])
def test_float8_writeback_lands_in_the_master_and_keeps_the_subclass(dist_run, dim1):
    _need_torchao_float8()
    dist_run(2, rank_float8_writeback_lands_in_the_master_and_keeps_the_subclass, dim1)


def rank_float8_weights_stream_cast_after_exact_masters(dim1: bool):
    model, reference = _float8_models(dim1=dim1)
    want = dict(reference.named_parameters())
    kept = {"2.weight", "2.bias"}
    for kwargs in ({}, {"dtype": torch.bfloat16}, {"dtype": torch.bfloat16, "keep_dtype": "2.*"},
                   {"dtype": torch.bfloat16, "rank0_only": False}):
        names = []
        for name, full in fsdp_shim.iter_full_params(model, **kwargs):
            names.append(name)
            if kwargs.get("rank0_only", True) and rank() != 0:
                assert full is None, name
                continue
            expected = want[name].detach()
            if "dtype" in kwargs and not ("keep_dtype" in kwargs and name in kept):
                expected = expected.to(kwargs["dtype"])
            assert type(full) is torch.Tensor and full.dtype == expected.dtype, (kwargs, name, type(full), full.dtype)
            assert torch.equal(full, expected), f"{name} differs under {kwargs}"
        assert names == list(want), names


@pytest.mark.parametrize("dim1", [False, True], ids=["dim0", "dim1-fallback"])
def test_float8_weights_stream_cast_after_exact_masters(dist_run, dim1):
    _need_torchao_float8()
    dist_run(2, rank_float8_weights_stream_cast_after_exact_masters, dim1)


def rank_float8_model_trains_after_a_summon():
    # FSDP2's own float8 gathers on gloo, without the shim: a unit of float8 bytes alone travels in float8,
    # which gloo lacks ("Invalid scalar type"); beside a bias, in uint8 (mixed dtypes), which it moves; and
    # a unit sharded unevenly (33 rows) aborts on a size mismatch. So every unit holds a bias and even rows.
    model, reference = _float8_models(first_bias=True, rows=32)
    reference = _to_float8(reference)
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model[2].weight.mul_(0.5)
        with torch.no_grad():
            reference[2].weight.mul_(0.5)
        torch.manual_seed(1)
        inputs = torch.randn(8, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(inputs).square().sum()  # FSDP2 gathers float8 bytes through the extension
        loss.backward()
        optimizer.step()
        reference_loss = reference(inputs).square().sum()  # the same float8 model, unsharded
        reference_loss.backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        torch.testing.assert_close(loss, reference_loss)  # float8 matmuls: close, not compared bit for bit
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.grad is not None, name
            if name.endswith("weight"):
                assert type(p._local_tensor) is _wrapper_type(), (name, type(p._local_tensor))
        with FSDP.summon_full_params(model, writeback=False):  # the step's new masters, summoned
            stepped = {name: p.detach().clone() for name, p in model.named_parameters()}
        for name, p in reference.named_parameters():
            torch.testing.assert_close(stepped[name], p.detach(), msg=lambda m, name=name: f"{name}: {m}")
        for unit in (model[0], model[2], model[3]):  # FSDP2's own unshard and reshard, after the summons
            unit.unshard()
            unit.reshard()
    for name, p in model.named_parameters():
        assert torch.equal(p.to_local().detach(), _shard_of(p, stepped[name])), name


def test_float8_model_trains_after_a_summon(dist_run):
    _need_torchao_float8()
    dist_run(2, rank_float8_model_trains_after_a_summon)
