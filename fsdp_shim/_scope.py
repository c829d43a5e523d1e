"""Which parameters a call covers: the ``recurse`` rule, ties, FSDP2 ownership, and the summon cache.

A *slot* is a ``(module, attribute name)`` pair; a parameter tied across two
modules has two slots (one ``_param.ScopedParam``). FSDP2 may hold a plain unsharded tensor in a slot (after
forward) where the sharded DTensor is what we gather, so slots that FSDP2
manages are resolved through its ``FSDPParam`` rather than the attribute.
The cache is at ``CachedSummon`` ([Note: summon cache]).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _registry as registry
from fsdp_shim._param import ScopedParam
from fsdp_shim._registry import SlotKey
from fsdp_shim._common import holds_distributed, scope_modules

if TYPE_CHECKING:
    from fsdp_shim._gather.layout import BucketPlan

#: A module holding summoned slots: the module, those slots (its tensors dict and the name), and
#: whether FSDP2 manages one of them.
SlotOwner = tuple[nn.Module, list[tuple[dict[str, Any], str]], bool]


def module_label(module: nn.Module) -> str:
    """How messages name a module: its class."""
    return type(module).__name__


def slot_key(module: nn.Module, name: str) -> SlotKey:
    return (id(module), name)


def slot_fqn(root: nn.Module, slot: tuple[nn.Module, str]) -> str:
    """``slot``'s name as seen from ``root`` (for error messages; walks the tree)."""
    module, name = slot
    for prefix, candidate in root.named_modules(remove_duplicate=False):
        if candidate is module:
            return f"{prefix}.{name}" if prefix else name
    return f"<{module_label(module)} outside {module_label(root)}>.{name}"


@dataclass
class Scope:
    root: nn.Module
    modules: list[nn.Module]
    params: list[ScopedParam]
    #: FSDP2 groups owning a scoped parameter, with whether every one of their
    #: parameters is summoned (by this call or an enclosing one).
    groups: dict[fsdp2.FSDPParamGroup, bool] = field(default_factory=dict)
    states: list[fsdp2.FSDPState] = field(default_factory=list)
    #: Slots in scope left to an enclosing context (already summoned).
    enclosed: list[SlotKey] = field(default_factory=list)
    #: ``states`` plus the states of every group a scoped parameter belongs to (``states_of``).
    involved_states: list[fsdp2.FSDPState] | None = None
    #: Whether a parameter slot in scope has no owner among ``states`` (owned by a state above the
    #: scope, or by none: a plain parameter), so that finding its owner looked at every state.
    owned_outside: bool = False
    #: Whether FSDP2 manages every entry (no tensor-parallel-only DTensor, no DTensor buffer).
    fsdp2_only: bool = False
    #: Each entry's ``FSDPParam``, in order, where FSDP2 manages every one (``fsdp2_only``), else None.
    managed: list[fsdp2.FSDPParam] | None = None
    #: The modules holding the entries' slots, with those slots (``slot_owners``): worked out once a scope.
    owners: list[SlotOwner] | None = None
    owner_modules: list[nn.Module] = field(default_factory=list)  # the same modules, alone
    #: The mesh each entry is gathered over, in order, where FSDP2's differs from the DTensor's own
    #: (``_fsdp2.gather_mesh``: see [Note: the group is FSDP2's]); None where no entry is FSDP2's.
    meshes: list[Any] | None = None


def slot_owners(scope: Scope) -> list[SlotOwner]:
    """Every module holding a slot of ``scope``'s entries, with those slots: kept on the scope, which
    a cached summon reuses."""
    owners = scope.owners
    if owners is None:
        by_module: dict[int, SlotOwner] = {}
        for entry in scope.params:
            for module, name in entry.slots:
                owner = by_module.get(id(module))
                if owner is None:
                    owner = by_module[id(module)] = (module, [], False)
                owner[1].append((entry.tensors(module), name))
                if entry.fsdp_param is not None and not owner[2]:
                    by_module[id(module)] = (module, owner[1], True)
        owners = scope.owners = list(by_module.values())
        scope.owner_modules = [owner[0] for owner in owners]
    return owners


@dataclass
class _Owners:
    """Which FSDPParam manages each slot, and every slot of each FSDPParam."""

    by_slot: dict[SlotKey, tuple[fsdp2.FSDPParam, fsdp2.FSDPParamGroup]] = field(default_factory=dict)
    slots: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)  # id(FSDPParam) -> slots


def fsdp_slot_owners(states: Iterable[fsdp2.FSDPState]) -> _Owners:
    owners = _Owners()
    for state in states:
        for group in fsdp2.param_groups(state):
            for fsdp_param in fsdp2.group_params(group):
                slots = owners.slots[id(fsdp_param)] = fsdp2.param_slots(fsdp_param)
                for module, name in slots:
                    owners.by_slot[slot_key(module, name)] = (fsdp_param, group)
    return owners


def tracked_sharded(
    fsdp_param: fsdp2.FSDPParam, group: fsdp2.FSDPParamGroup, module: nn.Module, name: str
) -> nn.Parameter | None:
    """FSDP2's sharded parameter behind slot ``(module, name)``, which ``fsdp_param`` manages; None if
    the slot holds something FSDP2 does not track (the refusal: ``_refusals.untracked_parameter``).

    The one test of "is this slot still FSDP2's", for the summon and the
    stream: both gather FSDP2's sharded parameter behind a slot, whatever
    form the slot holds (resharded, unsharded, post-forward, or a live
    context's full parameter), and both refuse where it holds something else.
    """
    value = module._parameters.get(name)
    sharded = fsdp2.sharded_param(fsdp_param)
    if value is sharded:  # the common answer, and every summon's
        return sharded
    behind: nn.Parameter | None = fsdp2.sharded_behind(fsdp_param, group, value)
    if behind is None and registry.owner_of((id(module), name)) is not None:
        return sharded  # a live context's full parameter: it stands for FSDP2's own
    return behind


def first_untracked_slot(entries: Iterable[ScopedParam], shardeds: Iterable[Any]) -> tuple[nn.Module, str] | None:
    """The first slot of ``entries`` that ``tracked_sharded`` refuses, or None.

    ``shardeds``: each entry's ``sharded()``, resolved by the caller: a slot
    still holding it (the common answer) costs no call.
    """
    for entry, sharded in zip(entries, shardeds, strict=True):
        fsdp_param = entry.fsdp_param
        if fsdp_param is None:
            continue
        for module, name in entry.slots:
            if module._parameters.get(name) is not sharded and \
                    tracked_sharded(fsdp_param, entry.group, module, name) is None:  # type: ignore[arg-type]  # an entry with an FSDPParam has its group
                return module, name
    return None


def has_distributed_params(modules: list[nn.Module]) -> bool:
    """Whether ``collect_scope`` over ``modules`` (a ``scope_modules`` list) could find anything to gather:
    ``_common.holds_distributed``, or a slot a live summon holds, or one FSDP2 manages."""
    if holds_distributed(modules):
        return True
    if registry.has_live_slots() and any(  # a live summon's slots, whatever this rank's hold: every rank alike
            registry.owner_of((id(m), name)) is not None or registry.holding(value) is not None
            for m in modules for name, value in (*m._parameters.items(), *m._buffers.items())):
        return True  # a slot tied to a live summon's tensor too (see [Note: what a slot stands for])
    owners = fsdp_slot_owners(fsdp2.all_fsdp_states()).by_slot  # unsharded slots hold plain tensors
    return any(slot_key(m, name) in owners for m in modules for name in m._parameters)


def enclosing_slots(
    root: nn.Module, recurse: bool, thread: int, modules: list[nn.Module] | None
) -> tuple[dict[SlotKey, registry.LiveContext], list[nn.Module]]:
    """The slots of ``root``'s scope that this thread's live contexts hold, each with its context, and the
    scope's modules (``scope_modules``; ``modules`` if the caller walked them already).

    The slots those contexts swapped, and every other slot of the scope that
    holds one of their tensors, full or sharded (a tie made inside one: see
    [Note: what a slot stands for] in ``_registry``): a nested call leaves them
    all to the enclosing context, on every rank alike, whichever form this
    rank's slot holds.
    """
    if modules is None:
        modules = scope_modules(root, recurse)
    mine = registry.slots_of_thread(thread)
    for module in modules:
        for name, value in (*module._parameters.items(), *module._buffers.items()):
            key = (id(module), name)
            if key in mine:
                continue
            held = registry.holding(value)
            if held is not None and held[0].thread == thread:
                mine[key] = held[0]
    return mine, modules


def collect_scope(
    root: nn.Module, recurse: bool, enclosing: Iterable[SlotKey] = (), modules: list[nn.Module] | None = None
) -> Scope:
    """The DTensor parameters ``summon_full_params(root, recurse)`` covers.

    ``enclosing`` holds the slots this thread's enclosing contexts already
    swapped: they are full already and are left to those contexts.
    ``modules``: ``scope_modules(root, recurse)`` if the caller walked the
    tree already (routing does).
    """
    enclosing = set(enclosing)
    if modules is None:
        modules = scope_modules(root, recurse)
    states = list({id(s): s for s in (fsdp2.fsdp_state_of(m) for m in modules) if s is not None}.values())
    # The units in scope usually own every slot; a submodule inside a unit is
    # owned by a state above it, found only by looking at every state.
    owners = fsdp_slot_owners(states)
    by_slot = owners.by_slot
    look_outside = any(
        (id(m), name) not in by_slot for m in modules for name, p in m._parameters.items() if p is not None)
    if look_outside:
        owners = fsdp_slot_owners(fsdp2.all_fsdp_states())
        by_slot = owners.by_slot
    by_identity: dict[int, ScopedParam] = {}
    params: list[ScopedParam] = []
    covered: set[SlotKey] = set(enclosing)
    enclosed: list[SlotKey] = []
    for module in modules:
        for name, value in module._parameters.items():
            if value is None:
                continue
            key = (id(module), name)  # slot_key, inlined: this loop runs on every summon
            if key in enclosing:
                enclosed.append(key)
                continue
            owner = by_slot.get(key)
            if owner is not None:
                identity: object = owner[0]
            elif isinstance(value, DTensor):
                identity = value
            else:
                continue  # a plain parameter: ignored_params, or not distributed
            entry = by_identity.get(id(identity))
            if entry is None:
                entry = ScopedParam([], *owner) if owner else ScopedParam([])
                by_identity[id(identity)] = entry
                params.append(entry)
            entry.slots.append((module, name))
            covered.add(key)
    buffers: dict[int, ScopedParam] = {}
    for module in modules:
        for name, buffer in module._buffers.items():
            key = slot_key(module, name)
            if key in enclosing:  # before the type: a rank0_only holder's slot holds a plain full tensor
                enclosed.append(key)
                continue
            if not isinstance(buffer, DTensor):
                continue
            entry = buffers.get(id(buffer))
            if entry is None:
                entry = buffers[id(buffer)] = ScopedParam([], is_buffer=True)
                params.append(entry)
            entry.slots.append((module, name))
    for entry in params:
        if entry.fsdp_param is not None:  # a tie reaches out of scope: keep it one object
            slots = owners.slots[id(entry.fsdp_param)]
            if len(slots) > 1 or enclosing:
                entry.slots = [(m, n) for m, n in slots if (id(m), n) not in enclosing]
                covered.update((id(m), n) for m, n in entry.slots)
    scope = Scope(root, modules, params)
    scope.owned_outside = look_outside
    scope.fsdp2_only = all(entry.fsdp_param is not None for entry in params)
    if scope.fsdp2_only:
        scope.managed = [entry.fsdp_param for entry in params]  # type: ignore[misc]  # fsdp2_only: none is None
    for entry in params:
        if entry.group is not None and entry.group not in scope.groups:
            scope.groups[entry.group] = all(
                (id(m), n) in covered
                for fsdp_param in fsdp2.group_params(entry.group)
                for m, n in owners.slots[id(fsdp_param)]
            )
    if any(entry.fsdp_param is not None for entry in params):
        scope.meshes = [None if entry.fsdp_param is None else fsdp2.gather_mesh(entry.fsdp_param) for entry in params]
    scope.states = states
    scope.enclosed = enclosed
    return scope


def sharded_params(scope: Scope) -> list[DTensor]:
    """Each scoped parameter's DTensor, as ``ScopedParam.sharded`` resolves it, in scope order."""
    if scope.managed is not None:
        return fsdp2.sharded_params(scope.managed)  # type: ignore[return-value]  # FSDP2's are DTensors
    return [entry.sharded() for entry in scope.params]  # type: ignore[misc]  # a scoped parameter is one


def states_of(scope: Scope) -> list[fsdp2.FSDPState]:
    """The FSDP2 states of the units in scope and of every group a scoped parameter belongs to.

    Worked out once per call: entry's lazy init and the forward hooks both ask.
    """
    if scope.involved_states is not None:
        return scope.involved_states
    states = {id(state): state for state in scope.states}
    for group in scope.groups:
        for unit in fsdp2.group_modules(group):
            state = fsdp2.fsdp_state_of(unit)
            if state is not None:
                states.setdefault(id(state), state)
    scope.involved_states = list(states.values())
    return scope.involved_states


# -- the summon cache ---------------------------------------------------------


Fingerprint = tuple[tuple[Any, ...], ...]


def fingerprint(modules: list[nn.Module]) -> Fingerprint:
    """The tree ``modules`` make: each one's class, parameter names and the types they hold,
    buffers and children by name and identity. See [Note: summon cache]."""
    parts = []
    for m in modules:  # every summon of a unit runs this: one flat tuple a module
        params, buffers, children = m._parameters, m._buffers, m._modules
        parts.append((type(m), *params, *map(type, params.values()), None, *buffers, *map(id, buffers.values()),
                      None, *children, *map(id, children.values())))
    return tuple(parts)


@dataclass(eq=False)
class CachedSummon:
    """What a summon of one unit worked out, reusable while ``matches``.

    [Note: summon cache]
    Weight sync summons every FSDP2 unit, one at a time, at every step: the same
    scope, spec checks and bucket plan each time, and on NCCL that loop costs
    host time, not bandwidth. So a summon of a unit from outside any context
    keeps what it worked out in a ``CachedSummon``, on the unit's FSDP2 state
    (``_fsdp2.unit_summon_cache``: a cached summon holds its module, so a global map
    would keep every model alive; the state lives as long as the module), keyed
    by ``(id(module), recurse)``. A scope is a function of the modules in it
    (classes, children, parameter and buffer slots) and of FSDP2's
    ``FSDPParam``s, fixed from ``fully_shard`` on. A cached summon serves a call
    only while all of this holds, and is replaced (or dropped) the first time it
    does not:
    - the same module object and the same ``recurse`` (the key);
    - the same ``fingerprint``: each module's class (``fully_shard`` changes
      it); its parameter slots by name and by the type of what they hold (a
      forward that leaves a unit unsharded puts plain tensors there; a slot
      added, emptied or filled); its buffers and children by name and identity;
    - every object named only by identity still alive: it holds those
      weakly (buffers, and children outside the scope, nested units), and a
      freed one marks it stale, since its id may be reused. What it holds
      is its scope, the modules it summons; a submodule removed from the tree
      is let go when the next summon of the unit replaces it (FSDP2
      itself holds every module whose parameters it manages);
    - its scope owns every parameter slot in it. A scope with a slot owned by
      a state above it, or by none, had its owner looked for among every
      state, which any ``fully_shard`` may change: it is never stored, and a
      cached summon for that key is dropped.
    Never cached: a call inside an enclosing context of the same thread (its
    scope depends on what is already summoned), and a module that is not a unit
    (no state to keep it on). What can change while the tree stays the same
    is checked on every call, cached or not: training state, threads, untracked
    slots, the meta device, live groups. The spec checks (placements, meshes)
    are skipped only for the very spec objects that passed last time
    (``checked_groups``), and the bucket plan checks its own key
    (``_gather.layout.bucket_plan``) against each call's tensors.

    ``scope`` is shared between the calls that reuse it: nothing writes to it
    after ``collect_scope`` but ``states_of``, which caches its answer there.
    The spec checks and the gather fill in the rest the first time it
    serves a call (``passed``, ``bucket_plan``).
    """

    scope: Scope
    recurse: bool
    fingerprint: Fingerprint
    #: Weak references to the objects ``fingerprint`` names by id (buffers, children); a freed one
    #: marks it ``stale``.
    watched: list[weakref.ref[Any]] = field(default_factory=list)
    stale: bool = False
    #: The DTensor specs the spec checks last passed, by entry, and whether they passed them for writeback too.
    checked_specs: list[Any] | None = None
    checked_writeback: bool = False
    #: The process groups the call gathers over (every dim of every mesh in scope).
    groups: list[dist.ProcessGroup] | None = None
    #: The bucket plan of the last gather, checked against each call's tensors by its key.
    bucket_plan: BucketPlan | None = None

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


def cached_scope(
    module: nn.Module, recurse: bool, modules: list[nn.Module] | None
) -> tuple[Scope, CachedSummon | None]:
    """The scope of a summon from outside any context, and the cached summon that serves it, if it
    can have one: the stored one while it matches, else a new one (see [Note: summon cache]).

    ``modules``: ``scope_modules(module, recurse)`` if the caller walked the tree already.
    """
    cache = fsdp2.unit_summon_cache(module)
    if cache is None:  # not a unit: nowhere to keep a cached summon, so none is worked out
        return collect_scope(module, recurse, modules=modules), None
    key = (id(module), recurse)
    cached = cache.get(key)
    if cached is not None and cached.matches(module, recurse):
        return cached.scope, cached
    if modules is None:
        modules = scope_modules(module, recurse)
    tree = fingerprint(modules)
    scope = collect_scope(module, recurse, modules=modules)
    if scope.owned_outside:
        cache.pop(key, None)
        return scope, None
    cached = CachedSummon(scope, recurse, tree)
    cached.watched = [weakref.ref(obj, cached._freed)
                    for m in modules for obj in (*m._buffers.values(), *m._modules.values()) if obj is not None]
    cache[key] = cached
    return scope, cached
