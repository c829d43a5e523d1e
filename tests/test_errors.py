"""The typed errors: public, and each a ``RuntimeError``, so that ``except RuntimeError`` written against
earlier releases still catches what it caught (the raising tests check each type where it is raised:
test_one_sided, test_fail_safe, test_param, test_health, test_every_rank_alike, test_patching)."""

from __future__ import annotations

import pytest

import fsdp_shim

TYPED = ("DestroyedGroupError", "GroupOutOfStepError", "UnsupportedTorchError", "WritebackRefusedError")


@pytest.mark.parametrize("name", TYPED)
def test_each_typed_error_is_public_and_a_runtime_error(name):
    assert name in fsdp_shim.__all__
    error = getattr(fsdp_shim, name)
    assert issubclass(error, RuntimeError) and error.__module__ == "fsdp_shim._errors"
    assert error.__doc__
