"""Summon plans: what a summon of one FSDP2 unit works out, kept and reused while its tree holds.

[Note: summon plans]
Weight sync summons every FSDP2 unit, one at a time, at every step: the same
scope, spec checks and gather plan each time, and on NCCL that loop costs
host time, not bandwidth. So a summon of a unit from outside any context
keeps what it worked out in a ``SummonPlan``, on the unit's FSDP2 state
(``_fsdp2_internals.kept_plans``: a plan holds its module, so a global map
would keep every model alive; the state lives as long as the module), keyed
by ``(id(module), recurse)``. A scope is a function of the modules in it
(classes, children, parameter and buffer slots) and of FSDP2's
``FSDPParam``s, fixed from ``fully_shard`` on. A stored plan serves a call
only while all of this holds, and is replaced (or dropped) the first time it
does not:
- the same module object and the same ``recurse`` (the key);
- the same ``fingerprint``: each module's class (``fully_shard`` changes
  it); its parameter slots by name and by the type of what they hold (a
  forward that leaves a unit unsharded puts plain tensors there; a slot
  added, emptied or filled); its buffers and children by name and identity;
- every object named only by identity still alive: the plan holds those
  weakly (buffers, and children outside the scope, nested units), and a
  freed one marks it stale, since its id may be reused. What the plan holds
  is its scope, the modules it summons; a submodule removed from the tree
  is let go when the next summon of the unit replaces the plan (FSDP2
  itself holds every module whose parameters it manages);
- its scope owns every parameter slot in it. A scope with a slot owned by
  a state above it, or by none, had its owner looked for among every
  state, which any ``fully_shard`` may change: it is never stored, and a
  stored plan for that key is dropped.
Never planned: a call inside an enclosing context of the same thread (its
scope depends on what is already summoned), and a module that is not a unit
(no state to keep a plan on). What can change while the tree stays the same
is checked on every call, plan or not: training state, threads, untracked
slots, the meta device, live groups. The spec checks (placements, meshes)
are skipped only for the very spec objects that passed last time
(``checked_groups``), and the gather plan checks its own key
(``_layout.plan_key``) against each call's tensors.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from fsdp_shim import _fsdp2_internals as fsdp2
from fsdp_shim._scope import Scope, collect_scope, scope_modules

Fingerprint = tuple[tuple[Any, ...], ...]


def fingerprint(modules: list[nn.Module]) -> Fingerprint:
    """The tree ``modules`` make: each one's class, parameter names and the types they hold,
    buffers and children by name and identity. See [Note: summon plans]."""
    parts = []
    for m in modules:  # every summon of a unit runs this: one flat tuple a module
        params, buffers, children = m._parameters, m._buffers, m._modules
        parts.append((type(m), *params, *map(type, params.values()), None, *buffers, *map(id, buffers.values()),
                      None, *children, *map(id, children.values())))
    return tuple(parts)


@dataclass(eq=False)
class SummonPlan:
    """What a summon of one unit worked out, reusable while ``matches``. See [Note: summon plans].

    ``scope`` is shared between the calls that reuse it: nothing writes to it
    after ``collect_scope`` but ``states_of``, which caches its answer there.
    The spec checks and the gather fill in the rest the first time the plan
    serves a call (``passed``, ``gather``).
    """

    scope: Scope
    recurse: bool
    fingerprint: Fingerprint
    #: Weak references to the objects ``fingerprint`` names by id (buffers, children); a freed one
    #: marks the plan ``stale``.
    watched: list[weakref.ref[Any]] = field(default_factory=list)
    stale: bool = False
    #: The DTensor specs the spec checks last passed, by entry, and whether they passed them for writeback too.
    checked_specs: list[Any] | None = None
    checked_writeback: bool = False
    #: The process groups the call gathers over (every dim of every mesh in scope).
    groups: list[dist.ProcessGroup] | None = None
    #: ``_layout.GatherPlan`` of the last gather, checked against each call's tensors by its key.
    gather: Any = None

    def matches(self, module: nn.Module, recurse: bool) -> bool:
        if self.stale or self.scope.root is not module or self.recurse != recurse:
            return False
        return fingerprint(self.scope.modules) == self.fingerprint

    def checked_groups(self, specs: list[Any], writeback: bool) -> list[dist.ProcessGroup] | None:
        """The groups found when these very spec objects passed the spec checks, else None."""
        if self.groups is None or self.checked_specs is None or (writeback and not self.checked_writeback):
            return None
        if len(specs) != len(self.checked_specs) or not all(map(operator.is_, specs, self.checked_specs)):
            return None  # by identity: equal meshes may hold other groups
        return self.groups

    def passed(self, specs: list[Any], writeback: bool, groups: list[dist.ProcessGroup]) -> None:
        """``specs`` passed the spec checks (for writeback too, if ``writeback``), gathering over ``groups``."""
        self.checked_specs, self.checked_writeback, self.groups = specs, writeback, groups

    def _freed(self, _: weakref.ref[Any]) -> None:
        self.stale = True


def plan_for(module: nn.Module, recurse: bool, modules: list[nn.Module] | None) -> tuple[Scope, SummonPlan | None]:
    """The scope of a summon from outside any context, and the plan that serves it, if it can
    have one: the stored one while it matches, else a new one (see [Note: summon plans]).

    ``modules``: ``scope_modules(module, recurse)`` if the caller walked the tree already.
    """
    state = fsdp2.fsdp_state_of(module) if fsdp2.is_fsdp2_module(module) else None
    if state is None:  # not a unit: nowhere to keep a plan, so none is worked out
        return collect_scope(module, recurse, modules=modules), None
    key = (id(module), recurse)
    kept = fsdp2.kept_plans(state)
    plan = kept.get(key)
    if plan is not None and plan.matches(module, recurse):
        return plan.scope, plan
    if modules is None:
        modules = scope_modules(module, recurse)
    tree = fingerprint(modules)
    scope = collect_scope(module, recurse, modules=modules)
    if scope.owned_outside:
        kept.pop(key, None)
        return scope, None
    plan = SummonPlan(scope, recurse, tree)
    plan.watched = [weakref.ref(obj, plan._freed)
                    for m in modules for obj in (*m._buffers.values(), *m._modules.values()) if obj is not None]
    kept[key] = plan
    return scope, plan
