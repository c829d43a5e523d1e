"""``_versions.served``: which torch the shim serves, its one owner (see [Note: version policy])."""

from __future__ import annotations

from fsdp_shim import _versions


def _never_asked() -> list[str]:
    raise AssertionError("the probe runs only for a release newer than the verified ones")


def test_a_supported_release_is_served_without_the_probe():
    assert _versions.served("2.7.0", _never_asked) is None


def test_a_newer_release_is_served_only_with_every_internal(monkeypatch):
    monkeypatch.delenv(_versions.ALLOW_UNSUPPORTED_TORCH_ENV, raising=False)
    newer = f"{_versions.NEXT_UNVERIFIED_TORCH}.0"
    assert _versions.served(newer, lambda: []) is None
    refusal = _versions.served(newer, lambda: ["FSDPParamGroup._sharded_state"])
    assert refusal is not None and "FSDPParamGroup._sharded_state" in refusal
    assert _versions.ALLOW_UNSUPPORTED_TORCH_ENV in refusal  # it says how to override


def test_an_older_release_is_refused_unless_allowed(monkeypatch):
    monkeypatch.delenv(_versions.ALLOW_UNSUPPORTED_TORCH_ENV, raising=False)
    refusal = _versions.served("2.6.0", _never_asked)
    assert refusal is not None and "outside the supported" in refusal
    monkeypatch.setenv(_versions.ALLOW_UNSUPPORTED_TORCH_ENV, "1")
    assert _versions.served("2.6.0", _never_asked) is None
