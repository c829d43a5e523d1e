"""NCCL detected as torch resolves it (issue 51, item 3): the backend that serves CUDA tensors, whatever the
user's spelling (``"nccl"``, ``"undefined"``, ``"cuda:nccl,cpu:gloo"``, ``"cpu:gloo,cuda:nccl"``), and the
unguarded-NCCL warning naming that spelling. No GPU is needed: the resolution is a function of the string,
a live gloo group is asked as torch would ask an NCCL one.
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from fsdp_shim import _health as health
from fsdp_shim._compat import cuda_backend_of
from fsdp_shim._health import serves_cuda_with_nccl, unguarded_nccl_warning

# --------------------------------------------------------------------------- NCCL as torch resolves it
SPELLINGS = [
    ("nccl", "nccl"),
    ("undefined", "nccl"),  # init_process_group() with no backend: NCCL serves CUDA tensors
    ("cuda:nccl,cpu:gloo", "nccl"),  # torchtune
    ("cpu:gloo,cuda:nccl", "nccl"),  # verl
    ("cpu:gloo, cuda:nccl", "nccl"),
    ("NCCL", "nccl"),
    ("gloo", "gloo"),
    ("cpu:gloo,cuda:gloo", "gloo"),  # what dist.get_backend_config says of a "gloo" group
    ("cpu:gloo", ""),  # no CUDA backend at all
]


@pytest.mark.parametrize(("spelling", "served"), SPELLINGS)
def test_the_backend_serving_cuda_tensors_as_torch_resolves_it(spelling, served):
    assert cuda_backend_of(spelling) == served


@pytest.mark.parametrize("spelling", ["nccl", "undefined", "cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl"])
def test_the_unguarded_warning_names_the_users_spelling(spelling):
    text = unguarded_nccl_warning(spelling, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert f"backend {spelling!r}" in text and "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in text, text
    assert "process-wide" in text and "watchdog" in text, text  # the remedy's cost is said


class _Group:
    """A stand-in process group for the once-a-group bookkeeping (weakly referenced)."""


def test_every_nccl_spelling_warns_once_a_group(monkeypatch, caplog):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    for spelling, served in SPELLINGS:
        monkeypatch.setattr(health, "serves_cuda_with_nccl",
                            lambda group, s=spelling: (cuda_backend_of(s) == "nccl", s))
        group = _Group()
        with caplog.at_level(logging.WARNING, logger="fsdp_shim"):
            caplog.clear()
            health.warn_if_unguarded([group, group])  # type: ignore[list-item]
            health.warn_if_unguarded([group])  # type: ignore[list-item]
        warned = [r.getMessage() for r in caplog.records if "NCCL serves" in r.getMessage()]
        assert len(warned) == (served == "nccl"), (spelling, warned)
        if warned:
            assert repr(spelling) in warned[0]


def rank_a_gloo_group_is_not_nccl():
    group = dist.new_group(list(range(dist.get_world_size())))
    return serves_cuda_with_nccl(group), serves_cuda_with_nccl(dist.group.WORLD)


def test_a_gloo_group_is_not_nccl(dist_run):
    assert dist_run(2, rank_a_gloo_group_is_not_nccl) == [((False, "gloo"), (False, "gloo"))] * 2
