"""What the package reads of FSDP2 and c10d, and whether this torch has it all: a static probe.

``READS`` names every FSDP2 (and c10d) internal ``_fsdp2_internals`` and the
rest of the package read; ``missing_internals`` checks them against the
installed torch. It runs without a process group, once, at activation on a
torch newer than the verified range (see [Note: version policy] in
``_versions``), and ``fsdp-shim check -v`` lists ``READS``.
"""

from __future__ import annotations

import sys
import types

import torch

# Through ``_fsdp2_internals``: importing the probe imports every FSDP2 module the package reads.
from fsdp_shim._fsdp2_internals import (
    FSDPParam,
    FSDPParamGroup,
    FSDPState,
    ParamModuleInfo,
    ShardedState,
    TrainingState,
)

# [Note: internals probe]
# What this package reads of FSDP2 and c10d, by owner. A method must be an
# attribute of its class; a field (set on instances, so invisible on the
# class) must be named somewhere in the class: an annotation, or an attribute
# any of its methods loads or stores. A name listed as a tuple needs one of
# its alternatives (releases differ). Methods include properties. Attributes read with a ``getattr``
# default are optional and not listed. The probe is static, so it runs
# without a process group, once, at activation on an unverified torch.
_METHODS: dict[type, tuple[str, ...]] = {
    FSDPState: ("_lazy_init",),
    FSDPParamGroup: ("_to_sharded", "is_sharded"),
    FSDPParam: ("reset_sharded_param",),
}
_FIELDS: dict[type, tuple[str | tuple[str, ...], ...]] = {
    FSDPState: ("_modules", "_training_state", "_state_ctx", "_is_root", ("_fsdp_param_groups", "_fsdp_param_group")),
    FSDPParamGroup: ("fsdp_params", "_sharded_state", "post_forward_mesh_info", "_training_state",
                     "_reset_sharded_params", "modules", "mesh_info"),
    FSDPParam: ("sharded_param", "_module_info", "_unsharded_param", "_sharded_post_forward_param",
                ("param_dtype", "mp_policy")),
    ParamModuleInfo: ("module", "param_name", "shared_modules", "shared_param_names"),
}
#: Everything probed, for ``fsdp-shim check -v``.
READS: tuple[str, ...] = tuple(
    f"{owner.__name__}.{name if isinstance(name, str) else ' or '.join(name)}"
    for table in (_METHODS, _FIELDS) for owner, names in table.items() for name in names
) + ("TrainingState.IDLE", "ShardedState.UNSHARDED", "torch._C._current_graph_task_id",
     "distributed_c10d._world.pg_map")


def _names_in(cls: type) -> set[str]:
    """Every attribute name ``cls`` defines, annotates, or loads or stores in its own code."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        names.update(vars(klass).get("__annotations__", {}))
        for value in vars(klass).values():
            functions = [value.fget, value.fset] if isinstance(value, property) else [getattr(value, "__func__", value)]
            stack = [f.__code__ for f in functions if hasattr(f, "__code__")]
            while stack:
                code = stack.pop()
                names.update(code.co_names)
                stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def missing_internals() -> list[str]:
    """The internals in ``READS`` this torch lacks, as ``Owner.name``; empty when all are there."""
    missing: list[str] = []
    for owner, methods in _METHODS.items():
        missing += [f"{owner.__name__}.{m}" for m in methods if getattr(owner, m, None) is None]
    for owner, fields in _FIELDS.items():
        names = _names_in(owner)
        for field_name in fields:
            alternatives = (field_name,) if isinstance(field_name, str) else field_name
            if not any(a in names for a in alternatives):
                missing.append(f"{owner.__name__}.{' or '.join(alternatives)}")
    for enum, member in ((TrainingState, "IDLE"), (ShardedState, "UNSHARDED")):
        if not hasattr(enum, member):
            missing.append(f"{enum.__name__}.{member}")
    if not callable(getattr(torch._C, "_current_graph_task_id", None)):
        missing.append("torch._C._current_graph_task_id")
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    if world is None or not hasattr(type(world), "pg_map"):
        missing.append("distributed_c10d._world.pg_map")
    return missing
