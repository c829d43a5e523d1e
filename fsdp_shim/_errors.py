"""The errors a caller may catch by type, each a ``RuntimeError``; importing nothing (no torch at import)."""

from __future__ import annotations

__all__ = ["DestroyedGroupError", "GroupOutOfStepError", "UnsupportedTorchError", "WritebackRefusedError"]


class GroupOutOfStepError(RuntimeError):
    """A gather was left part way on this rank, so its group is out of step; raised before any collective.
    Recover by recreating the group and its model, or restart."""


class DestroyedGroupError(RuntimeError):
    """A DTensor's device mesh uses a process group that was destroyed or belongs to another world."""


class UnsupportedTorchError(RuntimeError):
    """The shim cannot gather DTensor parameters here (a torch it does not serve, or inactive)."""


class WritebackRefusedError(RuntimeError):
    """A ``writeback=True`` exit refused before writing anything; every shard is as it was."""
