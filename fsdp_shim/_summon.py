"""The DTensor summon: one context object, from the call to the exit, driving each ``_param.SummonedParam``
and each FSDP2 group's ``_group.SummonedGroup`` as FSDP2's state drives its groups."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, ContextManager, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _health as health
from fsdp_shim import _registry as registry
from fsdp_shim._common import refuse_arguments, run_each
from fsdp_shim._gather.engine import Gathered, gather_full_tensors
from fsdp_shim._gather.layout import BucketCap, Receiver, bucket_cap, receivers_for_summon
from fsdp_shim._grads import agreed_grads, gather_grads
from fsdp_shim._group import Conversions, ForwardRefusal, SummonedGroup, summon_groups
from fsdp_shim._param import SummonedParam, carry_requires_grad, inspect_slots, to_full, to_sharded, write_back
from fsdp_shim._refusals import (
    refuse_before_anything,
    refuse_writeback_inside_no_writeback,
    validate_args,
)
from fsdp_shim._scope import (
    CachedSummon,
    Scope,
    cached_scope,
    collect_scope,
    enclosing_slots,
    has_distributed_params,
    module_label,
    slot_fqn,
    states_of,
)
from fsdp_shim._scope_rule import route

logger = logging.getLogger("fsdp_shim")


_FSDP1_PARAMETERS = ("module", "recurse", "writeback", "rank0_only", "offload_to_cpu", "with_grads")
_FSDP1_KEYWORDS = frozenset(_FSDP1_PARAMETERS)


def summon_full_params_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The active mode's wrapt wrapper on FSDP1's ``summon_full_params``. ``summon``'s positional parameters
    are FSDP1's; arguments FSDP1's signature does not take are refused in FSDP1's words."""
    if len(args) > 6 or not (args or "module" in kwargs) or kwargs and (
            not _FSDP1_KEYWORDS.issuperset(kwargs) or not kwargs.keys().isdisjoint(_FSDP1_PARAMETERS[:len(args)])):
        refuse_arguments(wrapped, args, kwargs)
    return summon(*args, fsdp1=wrapped, **kwargs)


def summon(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
    *,
    bucket_mb: float | None = None,
    fsdp1: Callable[..., ContextManager[Any]] | None = None,
) -> ContextManager[None]:
    """Route one call: FSDP1 trees to FSDP1's own implementation (``fsdp1``, if known), a scope holding
    DTensors to a ``DTensorSummon``, anything else to a null context, as FSDP1's is without FSDP1 state."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"summon_full_params expects an nn.Module, got {type(module).__name__}")
    served_by, modules = route(module, recurse, has_distributed_params)  # the walk, reused by the scope
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("summon_full_params(%s): route=%s", module_label(module), served_by)
    if served_by == "fsdp1":
        original = fsdp1 if fsdp1 is not None else FullyShardedDataParallel.summon_full_params
        return original(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)
    if served_by == "none":
        return contextlib.nullcontext()
    # At the call; FSDP1 checks at __enter__, which a with statement runs at once.
    validate_args(writeback, rank0_only, offload_to_cpu, with_grads)
    return DTensorSummon(SummonCall(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads,
                                    bucket_cap(bucket_mb), modules))


class SummonCall(NamedTuple):
    """One call's arguments (FSDP1's five and the module), its bucket cap, and the scope's modules if routing
    walked them (reused by the scope)."""

    module: nn.Module
    recurse: bool
    writeback: bool
    rank0_only: bool
    offload_to_cpu: bool
    with_grads: bool
    cap: BucketCap
    modules: list[nn.Module] | None = None


# [Note: faults]
# A failure before the body (on one rank or all, ``KeyboardInterrupt`` too) writes nothing, whatever ``writeback``
# says, and leaves the shards bit-identical: full tensors whose values never arrived must not reach the weights. A
# failure in the body keeps FSDP1's rule: writeback still applies, all or nothing, and the body's error propagates.
# Every posted collective is waited for before an error leaves, so a fault alike on every rank leaves the group
# usable; after a one-sided one this rank marks the group out of step (``_health``, ``docs/troubleshooting.md``).
#
# [Note: exit always restores]
# Inspection reads the slots, so it precedes their restore; the writeback comes last, onto restored shards. Whatever
# raises on the way, ``KeyboardInterrupt`` too, ``_release`` runs first and in full, then the error propagates; after
# a failed inspection nothing is written; grad mode is put back. The release is idempotent (each step forgets what it
# undid only once undone) and runs again when cut short, so an interrupt at any of its calls is finished by the
# second pass (``tests/test_interrupts.py`` injects at each).
class DTensorSummon:
    """``summon_full_params`` for DTensors, single-use; the registry's ``LiveContext``. ``__enter__`` refuses,
    prepares, gathers and installs, every rank's collectives aligned, or undoes what it did; ``__exit__``
    restores ([Note: faults], [Note: exit always restores])."""

    __slots__ = ("call", "thread", "scope", "summoned", "groups", "conversions", "_forward_refusal", "_claimed",
                 "_live", "_holds_fulls")

    def __init__(self, call: SummonCall) -> None:
        self.call = call
        self._live: bool | None = None  # None until entered; True from the gather's start to exit
        self.summoned: list[SummonedParam] = []
        self.groups: list[SummonedGroup] = []
        self.conversions = Conversions()
        self._forward_refusal: ForwardRefusal | None = None  # under ``rank0_only``: every forward refused
        self._claimed: list[dist.ProcessGroup] | None = None
        self._holds_fulls = False

    def __enter__(self) -> None:
        if self._live is not None:
            raise RuntimeError("a summon_full_params context can be entered once; call summon_full_params again")
        self._live = False
        call = self.call
        self.thread = thread = health.current_thread()
        scope, cached = _scope_of_call(call.module, call.recurse, call.writeback, thread, call.modules)
        if not scope.params:
            return  # no-op: nothing distributed in scope, or all summoned by an enclosing call
        # 1. refuse: alike on every rank, before any change or collective
        process_groups, shardeds = refuse_before_anything(call.module, scope, call.writeback, thread, cached)
        grad_enabled = torch.is_grad_enabled()
        self.scope, self._live = scope, True  # from here on there is something to undo
        self._claimed = process_groups
        try:  # the claim inside the try that releases it ([Note: claims] in ``_health``)
            health.claim(self, thread, process_groups, lambda: f"summon_full_params({module_label(call.module)})",
                           context=True)
            self.groups = [SummonedGroup(group, fully) for group, fully in scope.groups.items()]  # 2. prepare
            self._gather_and_install(_prepare(scope, shardeds, self.groups), cached, process_groups)  # 3. and 4.
        except BaseException as error:
            self._live = False
            self._release_after(error, grad_enabled)  # the body never ran: nothing inspected or written back
            raise

    def __exit__(self, exc_type: object, body_error: BaseException | None, traceback: object) -> None:
        if not self._live:
            return
        self._live = False
        try:
            self.restore()
        except BaseException as error:
            self._release_after(error)
            if body_error is not None and error is not body_error and error.__context__ is None:
                error.__context__ = body_error  # Python does not chain an error raised from inside torch's C++
            raise

    def _gather_and_install(self, dtensors: list[DTensor], cached: CachedSummon | None,
                            process_groups: list[dist.ProcessGroup]) -> None:
        """3. gather; 4. install where this rank holds full tensors. Registered on every rank alike: nested
        calls decide from the registry ([Note: every rank decides alike])."""
        scope, call, started = self.scope, self.call, time.perf_counter()
        receiver, holds_fulls = receivers_for_summon(call.rank0_only, scope.groups, scope.fsdp2_only)
        self._holds_fulls = holds_fulls
        posted, grad_inputs, failure = health.Call(), None, None
        try:  # left part way once a collective was posted, this rank marks the call's groups
            if call.with_grads:
                grad_inputs, grad_groups, failure = agreed_grads(call.module, scope, dtensors, call.writeback, self,
                                                                 posted)
                if grad_groups:
                    self._claimed = [*process_groups, *grad_groups]  # a new list: the cached summon has the first
            gathered, grads = _gather(scope, dtensors, cached, call.cap, receiver, holds_fulls,
                                      torch.device("cpu") if call.offload_to_cpu else None, grad_inputs, posted,
                                      failure)
        except BaseException as error:
            if posted.any:  # [Note: a one-sided fault leaves its own mark] in ``_health``
                health.mark_part_way(self._claimed or process_groups, error)
            raise
        self.summoned += map(SummonedParam, scope.params, dtensors, gathered.layouts)  # see [Note: hot path]
        if holds_fulls:
            to_full(self.summoned, gathered.tensors, grads, call.writeback)
        del gathered, grads
        registry.register(self)
        self._forward_refusal = summon_groups(self.groups, self.summoned, scope, self.conversions, holds_fulls,
                                              call.rank0_only)
        if self._forward_refusal is not None:
            self._forward_refusal.install()
        if logger.isEnabledFor(logging.DEBUG):
            _log_gathered(self, dtensors, started)

    def restore(self) -> None:
        """Hooks off, inspect, release, then replay and write back if the body ran ([Note: exit always restores])."""
        inspected, released, grad_enabled, call = False, False, torch.is_grad_enabled(), self.call
        try:
            try:
                for group in self.groups:  # one at a time: if a removal is interrupted, the release finishes
                    group.remove_hooks()
                if self._holds_fulls:  # elsewhere the slots kept their shards: nothing to inspect
                    inspect_slots(self.summoned, self.conversions.exit_dtype if call.writeback else None)
                inspected = True
            finally:
                self._release()
                released = True
            if inspected:
                carry_requires_grad(self.summoned)
                self.conversions.replay(self.summoned, self._name)
                if call.writeback:  # exit runs only after the body did: [Note: faults]
                    write_back(self.summoned, self._name, call.with_grads)
                    fsdp2.order_after_writeback(states_of(self.scope))
        finally:
            if released:  # else exit's second release needs the records (``_release_after``)
                self.summoned.clear()
            if torch.is_grad_enabled() is not grad_enabled:
                torch._C._set_grad_enabled(grad_enabled)

    def _name(self, param: SummonedParam) -> str:
        return slot_fqn(self.scope.root, param.slots[0])

    def _release(self) -> None:
        """Every slot gets back the exact object it held; then each group (the last made first), the forward
        refusal, registry entry and claims, each even if another raised (a failed ``to_sharded``: next pass)."""
        to_sharded(self.summoned)
        refusal = self._forward_refusal
        first = run_each([*(group.release for group in reversed(self.groups)),
                          None if refusal is None else refusal.remove, self.conversions.release])
        if first is None:
            self.groups = []
        registry.forget(self)  # a dict pop each: a second pass finds nothing
        health.release(self)
        if first is not None:
            raise first

    def _release_after(self, error: BaseException, grad_enabled: bool | None = None) -> None:
        """``_release`` after a failed entry or exit, twice if cut short; the second's failure is logged."""
        try:
            try:
                self._release()
            except BaseException:  # noqa: BLE001  # the second pass finishes it
                self._release()
            self.summoned.clear()
        except BaseException:  # logged: the caller sees ``error``
            logger.exception("summon_full_params: restoring after %r failed", error)
        finally:
            if grad_enabled is not None:  # entry: nothing releases again, so no record is kept
                self.summoned.clear()
                torch._C._set_grad_enabled(grad_enabled)


def _gather(
    scope: Scope, dtensors: list[DTensor], cached: CachedSummon | None, cap: BucketCap, receiver: Receiver,
    holds_fulls: bool, out_device: torch.device | None, grad_inputs: list[tuple[int, DTensor]] | None,
    posted: health.Call, failure: BaseException | None = None,
) -> tuple[Gathered, dict[int, torch.Tensor]]:
    """Every collective of an entry but the gradients' agreement; every value is in when it returns.
    ``failure``, an earlier one of this rank's, is agreed on with the parameters' allocations."""
    collective_bytes = cap.one_unit_bytes if len(scope.groups) == 1 and scope.fsdp2_only else None
    behind = health.CALLS_BEHIND  # paced by where this rank keeps nothing: [Note: bounded run-ahead] in ``engine``
    gathered = gather_full_tensors(dtensors, holds_fulls=holds_fulls, out_device=out_device,
                                   bucket_bytes=cap.bucket_bytes, receiver=receiver,
                                   plan=None if cached is None else cached.bucket_plan,
                                   collective_bytes=collective_bytes, meshes=scope.meshes, posted=posted,
                                   failure=failure, behind=behind)
    if cached is not None:
        cached.bucket_plan = gathered.plan
    grads = (gather_grads(grad_inputs, holds_fulls, out_device, cap.bucket_bytes, receiver, collective_bytes,
                          posted, scope.meshes, behind) if grad_inputs else {})
    return gathered, grads


def _log_gathered(context: DTensorSummon, dtensors: list[DTensor], started: float) -> None:
    nbytes = sum(d.numel() * d.element_size() for d in dtensors)
    logger.debug(
        "summon_full_params(%s): %d tensors, %.1f MiB gathered in %.1f ms (rank0_only=%s, full tensors "
        "on this rank=%s)", module_label(context.call.module), len(dtensors), nbytes / 2**20,
        (time.perf_counter() - started) * 1e3, context.call.rank0_only, context._holds_fulls,
    )


def _scope_of_call(
    module: nn.Module, recurse: bool, writeback: bool, thread: int, modules: list[nn.Module] | None
) -> tuple[Scope, CachedSummon | None]:
    """What this call covers, less what this thread's enclosing contexts hold; and the unit's cached summon, if any."""
    if not health.has_live_context(thread):
        return cached_scope(module, recurse, modules)
    mine, modules = enclosing_slots(module, recurse, thread, modules)  # ties made inside them too
    scope = collect_scope(module, recurse, mine, modules)
    if writeback:
        refuse_writeback_inside_no_writeback(module, [mine[key] for key in scope.enclosed])
    return scope, None


def _prepare(scope: Scope, resolved: list[DTensor], groups: list[SummonedGroup]) -> list[DTensor]:
    """FSDP2's groups in scope brought to a known state, all local: the root lazily initialised, then each group
    prepared (resets adopted, units left unsharded resharded). Returns the DTensors to gather: ``resolved`` unless
    a lazy init or an adoption ran, which may replace a parameter (resharding puts back the objects resolved).

    A unit left unsharded (the root after forward, ``reshard_after_forward=False``) is gathered from its sharded
    parameters, as FSDP2's ``state_dict()`` does: the optimizer updates those, and the unsharded copy may be stale.
    It stays sharded after exit, unlike FSDP1 (why: ``docs/semantics.md``)."""
    changed = fsdp2.lazy_init_root(states_of(scope))
    for group in groups:
        changed = group.prepare() or changed
    if not changed:
        return resolved
    dtensors: list[DTensor] = []
    for entry in scope.params:
        dtensor = entry.sharded()
        if not isinstance(dtensor, DTensor):
            raise AssertionError(f"expected a DTensor parameter at {entry.slots[0][1]!r}, got {type(dtensor)}")
        dtensors.append(dtensor)
    return dtensors


# [Note: every rank decides alike]
# Whatever chooses a call's collectives (whether any, which tensors, which buckets, a refusal) reads only state
# every rank shares: arguments, the module tree, FSDP2's state, DTensor specs, and the registry, which records every
# live context on every rank, holder of full tensors or not. Never what one rank holds (full tensors under
# ``rank0_only``, slot contents, ``.grad``): a slot tied to a live summon's tensor is that summon's on every rank; a
# nested call its enclosing contexts cover runs no collective anywhere (FSDP1's answer); which gradients exist is
# agreed by an all-reduce first, as FSDP1 does. Out-of-step marks are rank-local by nature. Exit and writeback run
# no collective. CI's newest row runs the suite under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (fails at the first mismatch).

# [Note: hot path]
# The weight-sync loop enters one summon a unit, so on NCCL a warm summon's host time is what users wait for
# (``docs/host-cost.md``). Each shortcut marked with this note stays only while ``scripts/fake_bench.py`` shows it
# pays: the summon and layout caches, one collective a dtype, a slotted context whose ``SummonedParam``s one ``map``
# makes, the C ``no_grad`` switch, the root state listed first.
