"""Real process groups for the tests: gloo on loopback, one pool per world size.

``dist_run(world_size, fn, *args)`` runs ``fn`` (a top-level function of a
test module) on every rank and returns the per-rank results (within the
pool's 120 s, or ``timeout_s=`` seconds). Pools live for
the session; a pool whose ranks failed or hung is torn down and the next test
gets a fresh one. Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (CI's newest row) every collective's fingerprint is
checked across ranks, except in tests marked ``one_sided``, whose ranks diverge by design: their ranks start
without it, in pools of their own. ``FSDP_SHIM_TEST_BACKEND=nccl`` runs the pools on NCCL, one GPU a rank, for the
tests written for any backend: the two-group weight sync on 3 GPUs is
``FSDP_SHIM_TEST_BACKEND=nccl python -m pytest tests/test_weight_sync.py -k "receives or stream"``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fsdp_shim.tools.launch import RankPool  # noqa: E402

_pools: dict[tuple[int, str | None], RankPool] = {}
_BACKEND = os.environ.get("FSDP_SHIM_TEST_BACKEND", "gloo")
_DEBUG = "TORCH_DISTRIBUTED_DEBUG"


def _pool(world_size: int) -> RankPool:
    if _BACKEND == "nccl" and world_size > torch.cuda.device_count():
        pytest.skip(f"{world_size} ranks on NCCL need {world_size} GPUs, {torch.cuda.device_count()} visible")
    key = (world_size, os.environ.get(_DEBUG))  # spawned ranks read the debug level as they start
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        pool = _pools[key] = RankPool(world_size, backend=_BACKEND, timeout_s=120)
    return pool


@pytest.fixture(autouse=True)
def _one_sided_without_detail(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("one_sided") is not None:
        monkeypatch.delenv(_DEBUG, raising=False)


@pytest.fixture(scope="session")
def dist_run() -> Iterator[Callable[..., list[Any]]]:
    def run(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        return _pool(world_size).run(fn, *args, timeout_s=timeout_s)

    yield run
    for pool in _pools.values():
        pool.close()
    _pools.clear()
