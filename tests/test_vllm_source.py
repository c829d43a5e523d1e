"""``fsdp_shim.vllm_weight_source``: the stream as vLLM's own ``WeightSource`` (2 gloo ranks).

Where vLLM's weight-transfer API is importable (CI's vLLM row: vLLM 0.33.0 on torch 2.14.1, see
``scripts/matrix.py``), the source is checked with vLLM's real classes: its ``WeightSource``, the
NCCL engine's sender check (``NCCLTrainerWeightTransferEngine._checked_iter``) and non-sender loop
(``_broadcast`` on a non-sender engine), and the packed wire format (``packed_tensor.pack_tensors``
and ``unpack_tensor``). Elsewhere those tests skip, saying why (``FSDP_SHIM_REQUIRE_VLLM=1`` turns
the skip into a failure: the CI row sets it), and the metadata tests that need no vLLM still run
on ``_vllm.wire_params``, the function behind ``metadata``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import fsdp_shim
from _helpers import LMConfig, assert_unchanged, build_lm, full_state, rank, shard_lm, snapshot, tokens_for
from _helpers import _COLLECTIVES, counting_collectives
from fsdp_shim import _vllm
from fsdp_shim._stream import check_stream_args

REQUIRE_ENV = "FSDP_SHIM_REQUIRE_VLLM"


def _why_no_vllm() -> str | None:
    """Why vLLM's ``WeightSource`` with ``iter_full()`` is not here, or None; imports nothing."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed (CI's vLLM row installs 0.33.0: python scripts/matrix.py --vllm)"
    base = Path(spec.origin).parent / "distributed" / "weight_transfer" / "base.py"
    if not base.exists() or "def iter_full" not in base.read_text():
        return f"this vLLM ({Path(spec.origin).parent}) has no WeightSource.iter_full (vLLM 0.33.0 has)"
    return None


NO_VLLM = _why_no_vllm()
needs_vllm = pytest.mark.skipif(NO_VLLM is not None and os.environ.get(REQUIRE_ENV) != "1",
                                reason=str(NO_VLLM))


def test_vllm_is_here_where_required():
    """CI's vLLM row must run the vLLM tests, never skip them."""
    if os.environ.get(REQUIRE_ENV) == "1":
        assert NO_VLLM is None, NO_VLLM


def _stream_order(model: nn.Module) -> list[str]:
    return [name for name, _ in fsdp_shim.iter_full_params(model, rank0_only=False)]


def _wrapped_lm() -> nn.Module:
    """The tied LM with every block under an activation-checkpointing wrapper, sharded, then compiled
    (``torch.compile``'s wrapper, never run): names carry ``_checkpoint_wrapped_module.`` and ``_orig_mod.``."""
    model = build_lm()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)
    return torch.compile(shard_lm(model))


class CollectiveRefused(RuntimeError):
    pass


@contextlib.contextmanager
def collectives_refused() -> Iterator[list[str]]:
    """``counting_collectives``' boundary (``torch.distributed``'s functions, looked up at each call), but
    each call is recorded and refused instead of run: on one rank alone a collective would hang."""
    ran: list[str] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def refused(name):
        def call(*args, **kwargs):
            ran.append(name)
            raise CollectiveRefused(f"torch.distributed.{name} called")
        return call

    for name in originals:
        setattr(dist, name, refused(name))
    try:
        yield ran
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


# --------------------------------------------------------------------------- no vLLM needed
def rank_wire_params_are_the_streams_pairs():
    """``metadata``'s tuples are exactly what the stream yields, in its order, with no collective."""
    ref, model = build_lm(), shard_lm(build_lm())
    wrapped = _wrapped_lm()
    reference = [name for name, _ in ref.named_parameters()]  # a tie once, under its first name
    cases = [
        dict(),
        dict(dtype=torch.bfloat16),
        dict(dtype=torch.bfloat16, keep_dtype="blocks.*.fc1.weight"),
        dict(dtype=torch.float16, keep_dtype=lambda name: name == "lm_head.weight"),  # the tie's second name
        dict(dtype=torch.bfloat16, bucket_mb=1e-4),
    ]
    for subject in (model, wrapped):
        for kwargs in cases:
            with counting_collectives() as counts:
                wire = _vllm.wire_params(subject, **kwargs)
            assert counts == {}, kwargs
            # the source matches keep_dtype against the name without wrapper segments too
            streamed = dict(kwargs, keep_dtype=_vllm.keep_matcher(kwargs.get("keep_dtype")))
            pairs = [(name, full.dtype, tuple(full.shape))
                     for name, full in fsdp_shim.iter_full_params(subject, rank0_only=False, **streamed)]
            assert [(w.dtype, w.shape) for w in wire] == [(d, s) for _, d, s in pairs], kwargs
            assert [w.name for w in wire] == [_vllm.strip_wrappers(name) for name, _, _ in pairs], kwargs
            assert sorted(w.name for w in wire) == sorted(reference)  # every parameter once, ties once
        assert [w.name for w in _vllm.wire_params(subject)] != reference  # not named_parameters() order
    kept = {w.name: w.dtype for w in _vllm.wire_params(wrapped, torch.bfloat16, keep_dtype="blocks.*.fc1.weight")}
    assert {n for n, d in kept.items() if d == torch.float32} == {f"blocks.{i}.fc1.weight" for i in range(2)}
    mapped = _vllm.wire_params(model, name_map=lambda name: f"model.{name}")
    assert [w.name for w in mapped] == [f"model.{name}" for name in _stream_order(model)]
    with pytest.raises(ValueError, match="are both named 'x'"):
        _vllm.wire_params(model, name_map=lambda name: "x")
    with pytest.raises(TypeError, match="returned 3, not a str"):
        _vllm.wire_params(model, name_map=lambda name: 3)


def test_wire_params_are_the_streams_pairs(dist_run):
    dist_run(2, rank_wire_params_are_the_streams_pairs)


def test_arguments_are_refused_as_the_stream_refuses_them():
    """Checked at the call, before vLLM is imported: the stream's refusals in its words, then the adapter's."""
    linear = nn.Linear(2, 2)
    bad = [
        dict(model=object()),
        dict(dtype=torch.int32),
        dict(keep_dtype=3),
        dict(bucket_mb=0),
        dict(device="no-such-device"),
    ]
    for kwargs in bad:
        args = {"model": linear, "dtype": None, "keep_dtype": None, "device": None, "bucket_mb": None, **kwargs}
        with pytest.raises((TypeError, ValueError, RuntimeError)) as stream_error:
            check_stream_args(args["model"], args["dtype"], args["bucket_mb"], args["keep_dtype"], args["device"])
        with pytest.raises(stream_error.type) as source_error:
            fsdp_shim.vllm_weight_source(args.pop("model"), args.pop("dtype"), **args)
        assert str(source_error.value) == str(stream_error.value)
    with pytest.raises(ValueError, match="receivers must be 'sender' or 'all'"):
        fsdp_shim.vllm_weight_source(linear, receivers="rank0")
    with pytest.raises(TypeError, match="name_map must be a callable"):
        fsdp_shim.vllm_weight_source(linear, name_map={"a": "b"})


def _fake_vllm(monkeypatch, base: types.ModuleType | None, version: str = "0.32.0") -> None:
    """``vllm.distributed.weight_transfer.base`` as given (None: vLLM cannot be imported)."""
    _vllm.source_class.cache_clear()
    names = ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer", "vllm.distributed.weight_transfer.base")
    if base is None:
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)
        return
    modules = [types.ModuleType(name) for name in names]
    modules[0].__version__ = version  # type: ignore[attr-defined]
    modules[2].base = base  # type: ignore[attr-defined]
    modules[3] = base
    for name, module in zip(names, modules, strict=True):
        monkeypatch.setitem(sys.modules, name, module)


def test_without_vllm_or_with_an_older_one_the_error_names_the_versions(monkeypatch):
    try:
        _fake_vllm(monkeypatch, None)
        with pytest.raises(ImportError, match=r"vLLM 0\.33\.0 \(verified\) and later.*vLLM cannot be imported"):
            fsdp_shim.vllm_weight_source(nn.Linear(2, 2))
        older = types.ModuleType("vllm.distributed.weight_transfer.base")
        older.ParamMeta = type("ParamMeta", (), {})  # type: ignore[attr-defined]
        older.WeightSource = type("WeightSource", (), {"metadata": lambda self: [], "__iter__": None})  # type: ignore[attr-defined]
        _fake_vllm(monkeypatch, older)
        with pytest.raises(ImportError, match=r"vLLM 0\.32\.0's vllm\.distributed\.weight_transfer\.base has no such"):
            fsdp_shim.vllm_weight_source(nn.Linear(2, 2))
    finally:
        _vllm.source_class.cache_clear()


def _stand_in_base() -> types.ModuleType:
    """A ``vllm.distributed.weight_transfer.base`` of 0.33.0's shape, with no vLLM behind it: the adapter's
    own ``metadata`` and ``iter_full()`` run on it as on vLLM's classes."""
    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    fields = [("name", str), ("dtype", torch.dtype), ("shape", tuple)]
    base.ParamMeta = NamedTuple("ParamMeta", fields)  # type: ignore[attr-defined,misc]
    base.WeightSource = type("WeightSource", (), {"iter_full": lambda self: iter(())})  # type: ignore[attr-defined]
    return base


def rank_iter_full_refuses_a_colliding_name_map_as_metadata_does():
    ref, model = build_lm(), shard_lm(build_lm())
    with pytest.MonkeyPatch.context() as monkeypatch:
        try:
            _fake_vllm(monkeypatch, _stand_in_base(), version="0.33.0")
            collide = fsdp_shim.vllm_weight_source(model, name_map=lambda name: "x", receivers="all")
            with collectives_refused() as ran, pytest.raises(ValueError, match="are both named 'x'") as first:
                for _ in collide.iter_full():  # driven directly, metadata never read
                    pass
            assert ran == [], ran  # refused before any collective, on every rank alike
            with pytest.raises(ValueError) as from_metadata:
                _ = collide.metadata
            assert str(first.value) == str(from_metadata.value)
            mapped = fsdp_shim.vllm_weight_source(model, name_map=lambda name: f"model.{name}", receivers="all")
            received = list(mapped.iter_full())  # the same group, still in step
        finally:
            _vllm.source_class.cache_clear()
    reference = dict(ref.named_parameters())
    assert [name for name, _ in received] == [f"model.{name}" for name in _stream_order(model)]
    for name, full in received:
        assert torch.equal(full, reference[name.removeprefix("model.")].detach()), name
    return True


def test_iter_full_refuses_a_colliding_name_map_as_metadata_does(dist_run):
    """Two parameters renamed alike: ``iter_full()`` driven without ``metadata`` refuses as ``metadata`` does."""
    assert dist_run(2, rank_iter_full_refuses_a_colliding_name_map_as_metadata_does) == [True, True]


# --------------------------------------------------------------------------- vLLM's own classes
def _through_the_wire(pairs, buffer_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """Pairs packed into vLLM's packed chunks and unpacked, as the packed NCCL path ships them (which keeps
    the yielded tensors until a chunk fills: they must keep their values)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    received = []
    iterator = iter(pairs)
    while (chunk := pack_tensors(iterator, post_iter_func=lambda item: item[1],
                                 buffer_size_bytes=buffer_bytes)) is not None:
        unpacked = unpack_tensor(chunk.packed_tensor, chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes)
        received += [(name, tensor.clone()) for name, tensor in unpacked]
    return received


def _send_round(source, sender: bool, buffer_bytes: int = 4096) -> list[tuple[str, torch.Tensor]] | None:
    """One round as vLLM's NCCL engine runs it: the sender checks every pair against ``metadata``
    (``_checked_iter``) into the packed wire format; a non-sender engine's ``_broadcast`` only drives
    ``iter_full()``."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine as Engine

    if sender:
        return _through_the_wire(Engine._checked_iter(source, source.metadata), buffer_bytes)
    engine = Engine(client=None, source=source, is_sender=False, rank=rank())
    engine._broadcast(source, source.metadata)
    return None


def _expected(ref: nn.Module, source) -> list[tuple[str, torch.Tensor]]:
    reference = dict(ref.named_parameters())
    return [(m.name, reference[m.name].detach().to(m.dtype)) for m in source.metadata]


def _assert_exact(received, expected) -> None:
    assert [name for name, _ in received] == [name for name, _ in expected]
    for (name, got), (_, want) in zip(received, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


def _train_step(model, ref, tokens):
    for m in (model, ref):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        m(tokens).float().pow(2).mean().backward()
        optimizer.step()


def rank_the_source_under_vllms_own_checks():
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    ref, model = build_lm(), shard_lm(build_lm())
    before = snapshot(model)
    source = fsdp_shim.vllm_weight_source(model, torch.bfloat16)
    assert isinstance(source, WeightSource) and source.implements_iter_full()
    assert isinstance(type(source).__dict__["metadata"], cached_property)
    ran: list[str] = []
    if rank() == 0:  # read on one rank alone: a collective is refused at once (it would hang) and named
        with collectives_refused() as ran:
            try:
                source.metadata
            except CollectiveRefused:
                pass
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ran)
    assert everyone == [[]] * dist.get_world_size(), f"metadata ran collectives: {everyone}"
    meta = source.metadata
    assert source.metadata is meta and all(isinstance(m, ParamMeta) and m.owners is None for m in meta)
    dist.all_gather_object(everyone, [(m.name, str(m.dtype), m.shape) for m in meta])
    assert all(other == everyone[0] for other in everyone)  # identical on every rank
    assert [m.name for m in meta] == _stream_order(model) != [n for n, _ in ref.named_parameters()]
    assert {m.dtype for m in meta} == {torch.bfloat16}
    assert [m.shape for m in meta] == [tuple(dict(ref.named_parameters())[m.name].shape) for m in meta]

    for _ in range(2):  # two rounds, each a fresh pass
        received = _send_round(source, sender=rank() == 0)
        if rank() == 0:
            _assert_exact(received, _expected(ref, source))
    assert_unchanged(model, before)

    everyone_source = fsdp_shim.vllm_weight_source(model, torch.bfloat16, receivers="all",
                                                   keep_dtype="blocks.*.fc1.weight")
    assert {m.name for m in everyone_source.metadata if m.dtype == torch.float32} == {"blocks.0.fc1.weight",
                                                                                    "blocks.1.fc1.weight"}
    _assert_exact(_send_round(everyone_source, sender=True), _expected(ref, everyone_source))  # every rank
    fp32 = fsdp_shim.vllm_weight_source(model)  # the stored dtype: exact fp32
    received = _send_round(fp32, sender=rank() == 0, buffer_bytes=1)  # a chunk per tensor
    if rank() == 0:
        _assert_exact(received, _expected(ref, fp32))
    assert_unchanged(model, before)

    tokens = tokens_for(LMConfig())
    _train_step(model, ref, tokens)  # training goes on, exactly
    state = full_state(model)
    for name, value in ref.named_parameters():
        assert torch.equal(state[name], value.detach()), name
    received = _send_round(source, sender=rank() == 0)  # the same source, the new weights
    if rank() == 0:
        _assert_exact(received, _expected(ref, source))


@needs_vllm
def test_the_source_under_vllms_own_checks(dist_run):
    dist_run(2, rank_the_source_under_vllms_own_checks, timeout_s=300)


def rank_checkpoint_wrappers_compile_and_a_tied_head():
    ref, model = build_lm(), _wrapped_lm()
    raw = [name for name, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in raw) and all(n.startswith("_orig_mod.") for n in raw)
    for receivers in ("sender", "all"):
        source = fsdp_shim.vllm_weight_source(model, torch.bfloat16, receivers=receivers,
                                              keep_dtype="blocks.*.fc1.weight")  # matched without the wrappers
        names = [m.name for m in source.metadata]
        assert sorted(names) == sorted(n for n, _ in ref.named_parameters())  # lm_head tied: once, as embed
        assert "embed.weight" in names and "lm_head.weight" not in names
        kept = {m.name for m in source.metadata if m.dtype == torch.float32}
        assert kept == {"blocks.0.fc1.weight", "blocks.1.fc1.weight"}
        received = _send_round(source, sender=receivers == "all" or rank() == 0)
        if received is not None:
            _assert_exact(received, _expected(ref, source))
    mapped = fsdp_shim.vllm_weight_source(model, name_map=lambda name: f"model.{name}", receivers="all")
    assert [m.name for m in mapped.metadata] == [f"model.{n}" for n in names]
    assert [name for name, _ in mapped.iter_full()] == [m.name for m in mapped.metadata]


@needs_vllm
def test_checkpoint_wrappers_compile_and_a_tied_head(dist_run):
    dist_run(2, rank_checkpoint_wrappers_compile_and_a_tied_head, timeout_s=300)


def rank_the_checks_bite_on_naive_adapters():
    """vLLM's sender check fails an adapter whose metadata follows ``named_parameters()``, and the
    collective count catches one whose metadata iterates the stream."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    model = shard_lm(build_lm())
    pairs = list(fsdp_shim.iter_full_params(model, dtype=torch.bfloat16, rank0_only=False))  # a whole pass

    class NamedParametersOrder(WeightSource):
        @cached_property
        def metadata(self):
            return [ParamMeta(name, torch.bfloat16, tuple(p.shape)) for name, p in model.named_parameters()]

        def iter_full(self):
            yield from pairs  # the stream's real pairs, in its order

    with pytest.raises(ValueError, match="metadata disagrees with iteration at index 1"):
        _send_round(NamedParametersOrder(), sender=True)

    class IteratingMetadata(NamedParametersOrder):
        @cached_property
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape))
                    for n, t in fsdp_shim.iter_full_params(model, dtype=torch.bfloat16, rank0_only=False)]

    with counting_collectives() as counts:  # on every rank, so that it completes
        IteratingMetadata().metadata
    assert counts != {}  # what test_the_source_under_vllms_own_checks asserts is {}
    ours = fsdp_shim.vllm_weight_source(model, torch.bfloat16, receivers="all")
    assert [(m.name, m.dtype, m.shape) for m in IteratingMetadata().metadata] == \
        [(m.name, m.dtype, m.shape) for m in ours.metadata]


@needs_vllm
def test_the_checks_bite_on_naive_adapters(dist_run):
    dist_run(2, rank_the_checks_bite_on_naive_adapters, timeout_s=300)


def rank_a_meta_model_is_refused_as_the_stream_refuses_it():
    with torch.device("meta"):
        model = shard_lm(build_lm())
    source = fsdp_shim.vllm_weight_source(model, torch.bfloat16)
    assert len(source.metadata) == len(_vllm.wire_params(build_lm()))  # shapes are known on the meta device
    errors = []
    for start in (lambda: next(iter(fsdp_shim.iter_full_params(model, dtype=torch.bfloat16))),
                  lambda: next(iter(source.iter_full()))):
        with pytest.raises(RuntimeError, match="is still on the meta device") as error:
            start()
        errors.append(str(error.value))
    assert errors[0] == errors[1]


@needs_vllm
def test_a_meta_model_is_refused_as_the_stream_refuses_it(dist_run):
    dist_run(2, rank_a_meta_model_is_refused_as_the_stream_refuses_it, timeout_s=300)
