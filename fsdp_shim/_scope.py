"""Which parameters a call covers (its modules by ``_scope_rule``'s ``recurse`` rule): ties, FSDP2 ownership, what
enclosing contexts hold; the summon cache. A slot FSDP2 manages may hold its plain unsharded tensor (after
forward), so it is resolved through its ``FSDPParam``, whose sharded DTensor is what is gathered.
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
from fsdp_shim._scope_rule import holds_distributed, scope_modules

if TYPE_CHECKING:
    from fsdp_shim._gather.layout import BucketPlan

#: A module, its summoned slots (its tensors dict and the name), and whether FSDP2 manages one of them.
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
    #: FSDP2 groups owning a scoped parameter: is every one of their parameters summoned (here or enclosing)?
    groups: dict[fsdp2.FSDPParamGroup, bool] = field(default_factory=dict)
    states: list[fsdp2.FSDPState] = field(default_factory=list)
    enclosed: list[SlotKey] = field(default_factory=list)  # slots left to an enclosing context
    involved_states: list[fsdp2.FSDPState] | None = None  # ``states_of``'s answer
    #: A parameter slot in scope has no owner among ``states``, so every state was searched for it.
    owned_outside: bool = False
    fsdp2_only: bool = False  # FSDP2 manages every entry
    managed: list[fsdp2.FSDPParam] | None = None  # each entry's ``FSDPParam`` where ``fsdp2_only``
    owners: list[SlotOwner] | None = None  # ``slot_owners``'s answer
    owner_modules: list[nn.Module] = field(default_factory=list)
    #: Each entry's gather mesh, FSDP2's where it differs from the DTensor's (``_fsdp2.gather_mesh``).
    meshes: list[Any] | None = None


def slot_owners(scope: Scope) -> list[SlotOwner]:
    """Every module holding a slot of ``scope``'s entries, with those slots; kept on the scope."""
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
    """FSDP2's sharded parameter behind slot ``(module, name)``, whatever form the slot holds (resharded,
    unsharded, post-forward, a live context's full parameter); None if it holds something FSDP2 does not
    track. The one test of "is this slot still FSDP2's", for the summon and the stream."""
    value = module._parameters.get(name)
    sharded = fsdp2.sharded_param(fsdp_param)
    if value is sharded:  # the common answer, and every summon's
        return sharded
    behind: nn.Parameter | None = fsdp2.sharded_behind(fsdp_param, group, value)
    if behind is None and registry.owner_of((id(module), name)) is not None:
        return sharded  # a live context's full parameter: it stands for FSDP2's own
    return behind


def first_untracked_slot(entries: Iterable[ScopedParam], shardeds: Iterable[Any]) -> tuple[nn.Module, str] | None:
    """The first slot of ``entries`` that ``tracked_sharded`` refuses, or None. ``shardeds``: each entry's
    ``sharded()``."""
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
    """Whether ``collect_scope`` over ``modules`` could find anything to gather: ``holds_distributed``, or a
    slot a live summon holds or is tied to (whatever this rank's slot holds), or one FSDP2 manages."""
    if holds_distributed(modules):
        return True
    if registry.has_live_slots() and any(
            registry.owner_of((id(m), name)) is not None or registry.holding(value) is not None
            for m in modules for name, value in (*m._parameters.items(), *m._buffers.items())):
        return True
    owners = fsdp_slot_owners(fsdp2.all_fsdp_states()).by_slot  # unsharded slots hold plain tensors
    return any(slot_key(m, name) in owners for m in modules for name in m._parameters)


def enclosing_slots(
    root: nn.Module, recurse: bool, thread: int, modules: list[nn.Module] | None
) -> tuple[dict[SlotKey, registry.LiveContext], list[nn.Module]]:
    """The slots of ``root``'s scope that this thread's live contexts swapped or that hold one of their
    tensors (a tie made inside: ``_registry.holding``), each with its context, and the scope's modules. A
    nested call leaves them all to the enclosing context, on every rank alike."""
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
    """The DTensor parameters ``summon_full_params(root, recurse)`` covers, but for the ``enclosing``
    slots, left to this thread's enclosing contexts."""
    enclosing = set(enclosing)
    if modules is None:
        modules = scope_modules(root, recurse)
    states = list({id(s): s for s in (fsdp2.fsdp_state_of(m) for m in modules) if s is not None}.values())
    # A submodule inside a unit is owned by a state above the scope: found only by searching every state.
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
    """The FSDP2 states of the units in scope and of every group a scoped parameter belongs to."""
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


Fingerprint = tuple[tuple[Any, ...], ...]


def fingerprint(modules: list[nn.Module]) -> Fingerprint:
    """The tree ``modules`` make: each one's class, parameter names and the types they hold, buffers and
    children by name and identity."""
    parts = []
    for m in modules:  # one flat tuple a module: every summon of a unit runs this
        params, buffers, children = m._parameters, m._buffers, m._modules
        parts.append((type(m), *params, *map(type, params.values()), None, *buffers, *map(id, buffers.values()),
                      None, *children, *map(id, children.values())))
    return tuple(parts)


@dataclass(eq=False)
class CachedSummon:
    """What a summon of one unit worked out (scope, spec checks, bucket plan), reusable while ``matches``.

    [Note: summon cache]
    Weight sync summons every unit at every step ([Note: hot path] in ``_summon``), so a summon from outside
    any context keeps a ``CachedSummon`` on the unit's FSDP2 state (a global map would keep every model
    alive), keyed by ``(id(module), recurse)``. A scope is a function of its modules and of FSDP2's
    ``FSDPParam``s, fixed from ``fully_shard`` on; the cached summon serves only while
    - ``fingerprint`` is the same: classes (``fully_shard`` changes them), parameter slots by name and held
      type (a forward that leaves a unit unsharded puts plain tensors there), buffers and children by identity;
    - every object named by identity is alive (held weakly: a freed one's id may be reused);
    - its scope owns every parameter slot in it: an owner found by searching every state may change with any
      ``fully_shard``, so such a scope is never stored.
    Never cached: a call inside an enclosing context of the same thread, a module that is not a unit. What may
    change under the same tree (training state, threads, untracked slots, the meta device, live groups) is
    checked on every call; spec checks are skipped only for the very spec objects that passed, the bucket plan
    checks its own key. Only ``states_of`` writes to the shared ``scope``.
    """

    scope: Scope
    recurse: bool
    fingerprint: Fingerprint
    watched: list[weakref.ref[Any]] = field(default_factory=list)  # what ``fingerprint`` names by id
    stale: bool = False
    checked_specs: list[Any] | None = None  # the specs that last passed, for writeback too if ``checked_writeback``
    checked_writeback: bool = False
    groups: list[dist.ProcessGroup] | None = None  # every dim of every mesh in scope
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
    """The scope of a summon from outside any context, and the cached summon that serves it, if it can
    have one: the stored one while it matches, else a new one."""
    cache = fsdp2.unit_summon_cache(module)
    if cache is None:
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
