"""``fsdp_shim.vllm_weight_source``: the adapter class (made at the first call: vLLM is optional) and the
names vLLM is told."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Generator, Iterator
from typing import Any, NamedTuple, cast

import torch
import torch.nn as nn

from fsdp_shim._gather.layout import bucket_cap, gathered_dtype
from fsdp_shim._stream import STREAM_BUCKET_MB, KeepDtype, batch_params, check_stream_args, name_matcher
from fsdp_shim._stream import stream_full_params

#: Wrapper segments (activation checkpointing, ``torch.compile``) removed, so names are the checkpoint's.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")

RECEIVERS = ("sender", "all")

VLLM_API = ("vllm.distributed.weight_transfer.base.WeightSource with a cached-property `metadata` and "
            "`iter_full()`, as in vLLM 0.33.0 (verified) and later; vLLM 0.28 to 0.32 have an earlier "
            "WeightSource (a metadata() method and __iter__) that this adapter does not serve")


class WireParam(NamedTuple):
    """One parameter as vLLM is told of it, and the name the stream yields it by (``streamed_as``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    streamed_as: str


def strip_wrappers(name: str) -> str:
    """``name`` without the segments in ``WRAPPER_SEGMENTS``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _renamer(name_map: Callable[[str], str] | None) -> Callable[[str], str]:
    def rename(name: str) -> str:
        stripped = strip_wrappers(name)
        if name_map is None:
            return stripped
        mapped = name_map(stripped)
        if not isinstance(mapped, str):
            raise TypeError(f"vllm_weight_source: name_map({stripped!r}) returned {mapped!r}, not a str")
        return mapped
    return rename


def keep_matcher(keep_dtype: KeepDtype) -> Callable[[str], bool] | None:
    """``keep_dtype`` matched against the model's name or the name without wrapper segments."""
    matcher = name_matcher(keep_dtype)
    if matcher is None:
        return None
    return lambda name: matcher(name) or matcher(strip_wrappers(name))


def check_source_args(model: object, dtype: object, keep_dtype: object, receivers: object, name_map: object,
                      device: object, bucket_mb: float | None) -> None:
    """Refuse bad arguments at the call: the stream's refusals, then the adapter's own."""
    check_stream_args(model, dtype, bucket_mb, keep_dtype, device)
    if receivers not in RECEIVERS:
        raise ValueError(f"vllm_weight_source: receivers must be 'sender' or 'all', got {receivers!r}")
    if name_map is not None and not callable(name_map):
        raise TypeError(f"vllm_weight_source: name_map must be a callable str -> str or None, got {name_map!r}")


def wire_params(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    keep_dtype: KeepDtype = None,
    name_map: Callable[[str], str] | None = None,
    bucket_mb: float | None = None,
) -> list[WireParam]:
    """The source's ``metadata``, no collective: the stream's own plan, so it cannot drift from ``iter_full()``.
    Two parameters renamed alike are refused from names only: alike on every rank."""
    bucket_bytes = bucket_cap(bucket_mb, STREAM_BUCKET_MB).bucket_bytes
    rename = _renamer(name_map)
    wire: list[WireParam] = []
    seen: dict[str, str] = {}
    for batch in batch_params(model, bucket_bytes, dtype, keep_matcher(keep_dtype)):
        for name, tensor, travels_as in zip(batch.names, batch.tensors, batch.casts, strict=True):
            renamed = rename(name)
            if renamed in seen:
                raise ValueError(f"vllm_weight_source: parameters {seen[renamed]!r} and {name!r} are both "
                                 f"named {renamed!r} (after removing wrapper segments and name_map)")
            seen[renamed] = name
            wire.append(WireParam(renamed, gathered_dtype(tensor, travels_as), tuple(tensor.shape), name))
    return wire


def _vllm_base() -> tuple[type, type]:
    """vLLM's ``WeightSource`` and ``ParamMeta``; ``ImportError`` naming the versions that have them."""
    try:
        base = importlib.import_module("vllm.distributed.weight_transfer.base")
    except ImportError as exc:
        raise ImportError(f"fsdp_shim.vllm_weight_source needs vLLM's weight-transfer API, {VLLM_API}: "
                          f"vLLM cannot be imported here ({exc})") from exc
    source, meta = getattr(base, "WeightSource", None), getattr(base, "ParamMeta", None)
    if source is None or meta is None or not callable(getattr(source, "iter_full", None)):
        version = getattr(importlib.import_module("vllm"), "__version__", "?")
        raise ImportError(f"fsdp_shim.vllm_weight_source needs {VLLM_API}; vLLM {version}'s "
                          "vllm.distributed.weight_transfer.base has no such WeightSource")
    return source, meta


@functools.cache
def source_class() -> type:
    """A subclass of vLLM's ``WeightSource``. ``metadata``: a ``cached_property`` (vLLM requires it), read on any
    rank any number of times, so no collective. It and ``iter_full()`` both come from ``wire_params``: they agree,
    as vLLM's sender check (``_checked_iter``) requires."""
    weight_source, param_meta = _vllm_base()

    class FsdpShimWeightSource(weight_source):  # type: ignore[valid-type,misc]  # vLLM's class, found at run time
        """vLLM's ``WeightSource`` over ``iter_full_params``."""

        def __init__(self, model: nn.Module, *, dtype: torch.dtype | None, keep_dtype: KeepDtype,
                     receivers: str, name_map: Callable[[str], str] | None, device: torch.device | str | None,
                     bucket_mb: float | None) -> None:
            self.model = model
            self.dtype = dtype
            self.keep_dtype = keep_dtype
            self.receivers = receivers
            self.name_map = name_map
            self.device = device
            self.bucket_mb = bucket_mb

        @functools.cached_property
        def metadata(self) -> list[Any]:
            """Every parameter once, in ``iter_full()``'s order, wire dtype and full shape; no collective."""
            return [param_meta(p.name, p.dtype, p.shape)
                    for p in wire_params(self.model, self.dtype, self.keep_dtype, self.name_map, self.bucket_mb)]

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor | None]]:
            """A fresh pass, a collective; ``wire_params`` made afresh refuses what ``metadata`` would."""
            renamed = {p.streamed_as: p.name for p in
                       wire_params(self.model, self.dtype, self.keep_dtype, self.name_map, self.bucket_mb)}
            stream = cast(  # a generator: closed at once if the caller stops early
                "Generator[tuple[str, torch.Tensor | None], None, None]",
                stream_full_params(self.model, dtype=self.dtype, rank0_only=self.receivers == "sender",
                                   device=self.device, bucket_mb=self.bucket_mb,
                                   keep_dtype=keep_matcher(self.keep_dtype)))
            try:
                for name, full in stream:
                    yield renamed[name], full
            finally:
                stream.close()  # stopped early: the stream waits for what it posted, now

        def __repr__(self) -> str:
            return (f"{type(self).__name__}({type(self.model).__name__}, dtype={self.dtype}, "
                    f"receivers={self.receivers!r})")

    FsdpShimWeightSource.__qualname__ = "FsdpShimWeightSource"
    return FsdpShimWeightSource


def make_source(model: nn.Module, dtype: torch.dtype | None, *, keep_dtype: KeepDtype, receivers: str,
                name_map: Callable[[str], str] | None, device: torch.device | str | None,
                bucket_mb: float | None) -> Any:
    """``fsdp_shim.vllm_weight_source`` after activation: arguments checked, then vLLM imported."""
    check_source_args(model, dtype, keep_dtype, receivers, name_map, device, bucket_mb)
    return source_class()(model, dtype=dtype, keep_dtype=keep_dtype, receivers=receivers, name_map=name_map,
                          device=device, bucket_mb=bucket_mb)
