"""The errors a caller may catch by type; importing nothing (``import fsdp_shim`` imports no torch).

Each subclasses the stdlib type the shim raised before it existed (``RuntimeError``),
so existing ``except RuntimeError`` clauses keep working (wrapt's style). Misuse that
FSDP1 refuses keeps FSDP1's own types (``NotImplementedError``, ``ValueError``, ...).
"""

from __future__ import annotations

__all__ = ["DestroyedGroupError", "GroupOutOfStepError", "UnsupportedTorchError", "WritebackRefusedError"]


class GroupOutOfStepError(RuntimeError):
    """A gather was left part way on this rank (a one-sided fault), so its process group is out of step
    here and any collective on it could hang or pair with the wrong one. Refused before any collective;
    the recovery is to destroy and recreate the group (and the model sharded on it), or restart the job."""


class DestroyedGroupError(RuntimeError):
    """A DTensor's device mesh uses a process group that was destroyed or belongs to another world."""


class UnsupportedTorchError(RuntimeError):
    """The shim cannot gather DTensor parameters here: a torch it does not serve (refusing mode), or it is
    inactive. Raised instead of FSDP1's silent no-op."""


class WritebackRefusedError(RuntimeError):
    """A ``writeback=True`` exit refused before writing anything (an edit in the shard and in the full
    tensor, a changed shape): every shard is as it was before the exit."""
