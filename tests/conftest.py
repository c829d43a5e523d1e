"""Real process groups for the tests: gloo on loopback, one pool per world size.

``dist_run(world_size, fn, *args)`` runs ``fn`` (a top-level function of a
test module) on every rank and returns the per-rank results (within the
pool's 120 s, or ``timeout_s=`` seconds). Pools live for
the session; a pool whose ranks failed or hung is torn down and the next test
gets a fresh one. ``FSDP_SHIM_TEST_BACKEND=nccl`` runs the pools on NCCL, one GPU a rank, for the
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

_pools: dict[int, RankPool] = {}
_BACKEND = os.environ.get("FSDP_SHIM_TEST_BACKEND", "gloo")


def _pool(world_size: int) -> RankPool:
    if _BACKEND == "nccl" and world_size > torch.cuda.device_count():
        pytest.skip(f"{world_size} ranks on NCCL need {world_size} GPUs, {torch.cuda.device_count()} visible")
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size, backend=_BACKEND, timeout_s=120)
    return pool


@pytest.fixture(scope="session")
def dist_run() -> Iterator[Callable[..., list[Any]]]:
    def run(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        return _pool(world_size).run(fn, *args, timeout_s=timeout_s)

    yield run
    for pool in _pools.values():
        pool.close()
    _pools.clear()
