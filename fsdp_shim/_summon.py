"""The DTensor summon: one context object, from the call to the exit.

Owns the order of entry (refuse, prepare, gather, install) and of exit (restore, replay, write back):
[Note: summon lifecycle] at ``summon``, and the rules for faults: [Note: faults] at ``DTensorSummon``.
The checks of entry (and FSDP1's argument checks, at the call) are in ``_refusals``, in the words the
stream shares: a refusal leaves everything as it was. Each parameter's part is a ``_param.SummonedParam``,
each FSDP2 group's a ``_group.SummonedGroup``; the context drives them, as FSDP2's state drives its groups.
What chooses the collectives, and why every rank chooses alike: [Note: every rank decides alike], at the end
of this module.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _health as health
from fsdp_shim import _registry as registry
from fsdp_shim._common import refuse_arguments, route, run_each
from fsdp_shim._gather.engine import Gathered, gather_full_tensors
from fsdp_shim._gather.layout import BucketCap, Receiver, bucket_cap, receivers_for_summon
from fsdp_shim._grads import agreed_grads, gather_grads
from fsdp_shim._group import Conversions, SummonedGroup, summon_groups
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

logger = logging.getLogger("fsdp_shim")


#: FSDP1's parameters, in its order.
_FSDP1_PARAMETERS = ("module", "recurse", "writeback", "rank0_only", "offload_to_cpu", "with_grads")
_FSDP1_KEYWORDS = frozenset(_FSDP1_PARAMETERS)


def summon_full_params_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapt wrapper on ``FullyShardedDataParallel.summon_full_params`` in active mode (``_patching``
    installs it): FSDP1's arguments, bound by ``summon``'s signature, whose positional parameters are
    FSDP1's (``test_patching`` checks). Arguments FSDP1's signature does not take (too many, a keyword
    it lacks, ``module`` missing or given twice) are refused in FSDP1's words (``refuse_arguments``)."""
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
    """Route one call. ``fsdp1`` is FSDP1's original, if known.

    [Note: summon lifecycle]
    ``summon`` routes the call: FSDP1 module trees to FSDP1's own
    implementation, untouched; a module with DTensors in scope (FSDP2, HSDP,
    tensor parallel) to a ``DTensorSummon``; anything else to a null context, as
    FSDP1's is for a module without FSDP1 state. Entry, in an order that keeps
    every rank's collectives aligned and leaves nothing changed if it fails part
    way:
    1. *Refuse*: ``collect_scope`` (no side effects), then every misuse
       (training state, threads, meta device, placements, dead groups) raises
       before any collective or change (``refuse_before_anything``).
    2. *Prepare*: FSDP2 groups in scope are brought to a known state: the root
       above them lazily initialised (see [Note: lazy init on entry] in
       ``_fsdp2.lazy_init_root``), parameter resets adopted
       (``adopt_module_params``), units left unsharded by a forward resharded.
       All local.
    3. *Gather*: one batched gather (``gather_full_tensors``), then gradients
       if asked for. Every value has arrived when it returns.
    4. *Install*, rank-local: each full tensor becomes one new ``nn.Parameter``
       placed in every slot of its parameter (ties stay one object); fully
       summoned groups are marked (see [Note: summoned groups] in ``_fsdp2``);
       forward hooks are installed.
    Exit (``DTensorSummon.restore``), always, also when the body raised: hooks
    off, every slot gets back the exact object it held and every mark is undone,
    conversions made inside are replayed on the shards (see [Note: conversions
    inside] in ``_group``), then writeback if asked (local copies into the
    original shards, see [Note: writeback needs no collective] in ``_param``)
    and if the body ran: as FSDP1 does, after a body that raised too, but never
    after a fault before the body (see [Note: faults]).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"summon_full_params expects an nn.Module, got {type(module).__name__}")
    served_by, modules = route(module, recurse, has_distributed_params)  # the walk, reused by the scope
    if logger.isEnabledFor(logging.DEBUG):  # the label is worked out only when it is logged
        logger.debug("summon_full_params(%s): route=%s", module_label(module), served_by)
    if served_by == "fsdp1":
        original = fsdp1 if fsdp1 is not None else FullyShardedDataParallel.summon_full_params
        return original(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)
    if served_by == "none":
        return contextlib.nullcontext()
    # Checked at the call, which a with statement makes at once: FSDP1 checks at __enter__, one step later.
    validate_args(writeback, rank0_only, offload_to_cpu, with_grads)
    return DTensorSummon(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads, bucket_cap(bucket_mb),
                         modules)


# [Note: faults]
# Two rules, FSDP1's for the body and a stricter one for entry:
# - A failure before the body runs (a gather error or timeout, a peer that
#   stalls or dies, an exception or ``KeyboardInterrupt`` in an allocation,
#   a copy or an all-gather, on one rank or all) writes nothing: the slots get their
#   objects back, marks and hooks are undone, and the shards stay
#   bit-identical, whatever ``writeback`` says. Full tensors whose values
#   never arrived are never read: written back, they would put uninitialised
#   memory into the training weights.
# - A failure inside the body (the body reached means every value arrived)
#   keeps FSDP1's rule: writeback still applies to the edits made there, all
#   or nothing (see [Note: exit checks] in ``_param``), and the body's exception propagates.
# Every collective already posted is waited for before the error leaves
# (see [Note: every posted work is waited for] in ``_gather.engine``), so a fault
# that hits every rank alike before the first collective leaves the group
# usable. After a one-sided fault the group is out of step (the other
# ranks' matching collective is still posted, or timed out): a rank whose
# wait failed records it, and so does a rank that left the gather part way
# (see [Note: a one-sided fault leaves its own mark] in ``_health``);
# its later summons and streams over that group refuse at once (see
# [Note: out of step] in ``_health``); ``docs/troubleshooting.md`` says
# what to do.
#
# [Note: exit always restores]
# ``inspect`` reads what the slots hold, so it comes before the slots
# get their objects back; the writeback comes last, onto the restored
# shards. Whatever raises on the way (the inspection of a slot that
# cannot be read, a replayed conversion, a refused or failing
# writeback, a ``KeyboardInterrupt``), ``_release`` runs first and in
# full: every slot holds its original object, every group is released
# (FSDP2's marks and suspended hooks undone, the forward hooks off), and
# the registry forgets the context and its group claims. Only then does
# the error propagate (Python chains the body's own error, if any, as
# its ``__context__``). A failed inspection writes nothing back: what
# changed is unknown, so the writeback's all or nothing is nothing.
# Grad mode is put back too: an interrupt inside a ``no_grad`` block's
# own exit (the writeback runs under one) would leave it off for the
# thread. The release is idempotent (each step forgets what it undid
# only once undone), and ``__exit__`` runs it again when the
# first was cut short (``_release_after``), so an interrupt at any call
# of the release is finished by the second pass. Python lets no library
# shield the first bytecodes of ``__exit__`` itself; every call after
# them is covered (``tests/test_interrupts.py`` injects at each).
class DTensorSummon:
    """``summon_full_params`` for DTensors: a single-use context manager, one object from the call to the exit
    (to the registry, ``registry.LiveContext``). Entered, it holds ``summoned`` (a ``SummonedParam`` for each
    parameter in scope, in scope order, on every rank), ``groups`` (a ``SummonedGroup`` each), ``conversions``
    ([Note: conversions inside] in ``_group``) and its group claims. ``__enter__`` refuses, prepares, gathers,
    installs ([Note: summon lifecycle]), or undoes what it did; ``__exit__`` restores, also when the body
    raised ([Note: faults], [Note: exit always restores])."""

    __slots__ = ("module", "recurse", "writeback", "rank0_only", "offload_to_cpu", "with_grads", "cap", "_modules",
                 "_entered", "thread", "scope", "summoned", "groups", "conversions", "_forward_refusal", "_body_ran",
                 "_claimed", "_live", "_holds_fulls")

    def __init__(
        self, module: nn.Module, recurse: bool, writeback: bool, rank0_only: bool, offload_to_cpu: bool,
        with_grads: bool, cap: BucketCap, modules: list[nn.Module] | None = None,
    ) -> None:
        self.module, self.recurse, self.writeback = module, recurse, writeback
        self.rank0_only, self.offload_to_cpu, self.with_grads = rank0_only, offload_to_cpu, with_grads
        self.cap = cap
        self._modules = modules  # the scope's modules, if routing walked them; dropped at entry
        self._entered = self._live = False  # ``_live``: whether ``__exit__`` has anything to restore
        self.summoned: list[SummonedParam] = []
        self.groups: list[SummonedGroup] = []
        self.conversions = Conversions()
        self._forward_refusal: RemovableHandle | None = None  # under ``rank0_only``: every forward refused
        self._claimed: list[dist.ProcessGroup] | None = None  # the process groups it gathers over, claimed
        self._body_ran = self._holds_fulls = False  # a writeback only after the body ran: see [Note: faults]

    def __enter__(self) -> None:
        if self._entered:
            raise RuntimeError("a summon_full_params context can be entered once; call summon_full_params again")
        self._entered = True
        self.thread = thread = health.current_thread()
        scope, cached = _scope_of_call(self.module, self.recurse, self.writeback, thread, self._modules)
        self._modules = None
        if not scope.params:
            return  # no-op: nothing distributed in scope, or all summoned by an enclosing call
        # 1. refuse: misuse raises here, alike on every rank, before any change or collective.
        process_groups, shardeds = refuse_before_anything(self.module, scope, self.writeback, thread, cached)
        grad_enabled = torch.is_grad_enabled()
        self.scope, self._live = scope, True  # from here on there is something to undo
        self._claimed = process_groups
        try:  # the claim inside the try that releases it: see [Note: claims] in ``_health``
            health.claim(self, thread, process_groups, lambda: f"summon_full_params({module_label(self.module)})",
                           context=True)
            # 2. prepare: FSDP2's groups in a known state; the DTensors to gather, resolved once.
            self.groups = [SummonedGroup(group, fully) for group, fully in scope.groups.items()]
            self._gather_and_install(_prepare(scope, shardeds, self.groups), cached, process_groups)  # 3. and 4.
            self._body_ran = True  # See [Note: faults]
        except BaseException as error:
            self._live = False
            self._release_after(error, grad_enabled)  # the body never ran: nothing inspected or written back
            raise

    def __exit__(self, exc_type: object, body_error: BaseException | None, traceback: object) -> None:
        if not self._live:
            return  # no-op context
        self._live = False
        try:
            self.restore()  # raising or not, everything is restored first: see [Note: exit always restores]
        except BaseException as error:
            self._release_after(error)
            if body_error is not None and error is not body_error and error.__context__ is None:
                error.__context__ = body_error  # Python does not chain an error raised from inside torch's C++
            raise

    def _gather_and_install(self, dtensors: list[DTensor], cached: CachedSummon | None,
                            process_groups: list[dist.ProcessGroup]) -> None:
        """3. gather (``_gather``); 4. install: a ``SummonedParam`` for each tensor, put to full where this rank
        holds full tensors; the context registered on every rank alike ([Note: every rank decides alike])."""
        scope, started = self.scope, time.perf_counter()
        receiver, holds_fulls = receivers_for_summon(self.rank0_only, scope.groups, scope.fsdp2_only)
        self._holds_fulls = holds_fulls
        posted, grad_inputs, failure = health.Call(), None, None
        if self.with_grads:  # which exist anywhere, agreed by every rank; those on another mesh claimed
            grad_inputs, grad_groups, failure = agreed_grads(self.module, scope, dtensors, self.writeback, self,
                                                             posted)
            if grad_groups:
                self._claimed = [*process_groups, *grad_groups]  # a new list: the cached summon holds the first
        gathered, grads = _gather(scope, dtensors, cached, self.cap, receiver, holds_fulls,
                                  torch.device("cpu") if self.offload_to_cpu else None, grad_inputs,
                                  self._claimed or process_groups, posted, failure)
        self.summoned += map(SummonedParam, scope.params, dtensors, gathered.layouts)  # see [Note: hot path]
        if holds_fulls:
            to_full(self.summoned, gathered.tensors, grads, self.writeback)
        del gathered, grads
        registry.register(self)
        self._forward_refusal = summon_groups(self.groups, self.summoned, scope, self.conversions, holds_fulls,
                                              self.rank0_only)
        if logger.isEnabledFor(logging.DEBUG):
            _log_gathered(self, dtensors, started)

    def restore(self) -> None:
        """Undo the entry: the groups' casts and forward hooks off, inspect (holders), release, then replay
        and writeback if the body ran. See [Note: exit always restores]."""
        inspected, released, grad_enabled = False, False, torch.is_grad_enabled()
        try:
            try:
                for group in self.groups:  # one at a time: if a removal is interrupted, the release finishes
                    group.remove_hooks()
                if self._holds_fulls:  # elsewhere the slots kept their shards: nothing to inspect
                    inspect_slots(self.summoned, self.conversions.exit_dtype if self.writeback else None)
                inspected = True
            finally:
                self._release()
                released = True
            if inspected:
                carry_requires_grad(self.summoned)
                self.conversions.replay(self.summoned, self._name)
                if self.writeback and self._body_ran:
                    write_back(self.summoned, self._name, self.with_grads)
                    fsdp2.order_after_writeback(states_of(self.scope))
        finally:
            if released:  # else exit's second release needs the records (``_release_after``)
                self.summoned.clear()
            if torch.is_grad_enabled() is not grad_enabled:
                torch._C._set_grad_enabled(grad_enabled)

    def _name(self, param: SummonedParam) -> str:
        return slot_fqn(self.scope.root, param.slots[0])

    def _release(self) -> None:
        """Every slot gets back the exact object it held; then every group released (the last made first),
        the forward refusal, registry entry and claims undone, each even if another raised, the first error
        raised after all (a failed ``to_sharded`` leaves them to the next pass): [Note: exit always restores]."""
        to_sharded(self.summoned)
        refusal = self._forward_refusal
        first = run_each([*(group.release for group in reversed(self.groups)),
                          None if refusal is None else refusal.remove, self.conversions.release])
        if first is None:
            self.groups = []
        registry.forget(self)  # a dict pop each: a second pass finds nothing ([Note: claims] in ``_health``)
        health.release(self)
        if first is not None:
            raise first

    def _release_after(self, error: BaseException, grad_enabled: bool | None = None) -> None:
        """``_release`` after a failed entry or exit, twice if cut short (each pass finishes what the one before
        did not reach); a failure of the last is logged, so that the caller sees ``error``; grad mode put back."""
        try:
            try:
                self._release()
            except BaseException:  # noqa: BLE001  # the second pass finishes it
                self._release()
            self.summoned.clear()
        except BaseException:  # logged: ``error`` is the caller's to see
            logger.exception("summon_full_params: restoring after %r failed", error)
        finally:
            if grad_enabled is not None:  # entry: nothing releases again, so no record is kept
                self.summoned.clear()
                torch._C._set_grad_enabled(grad_enabled)


def _gather(
    scope: Scope, dtensors: list[DTensor], cached: CachedSummon | None, cap: BucketCap, receiver: Receiver,
    holds_fulls: bool, out_device: torch.device | None, grad_inputs: list[tuple[int, DTensor]] | None,
    groups: list[dist.ProcessGroup], posted: health.Call, failure: BaseException | None = None,
) -> tuple[Gathered, dict[int, torch.Tensor]]:
    """Every collective of an entry but the gradients' agreement: the parameters, then the agreed gradients.
    Every value is in when it returns; left part way (``posted``: the call's record, set already where the
    agreement ran), it marks ``groups`` out of step on this rank (see [Note: a one-sided fault leaves its
    own mark] in ``_gather.engine``). The plan is kept on ``cached``; ``failure``, an earlier one of this rank's,
    is agreed on with the parameters' allocations."""
    collective_bytes = cap.one_unit_bytes if len(scope.groups) == 1 and scope.fsdp2_only else None
    behind = health.calls_behind(groups[0])  # the run-ahead bound, kept with the group
    try:
        gathered = gather_full_tensors(dtensors, holds_fulls=holds_fulls, out_device=out_device,
                                       bucket_bytes=cap.bucket_bytes, receiver=receiver,
                                       plan=None if cached is None else cached.bucket_plan,
                                       collective_bytes=collective_bytes, meshes=scope.meshes, posted=posted,
                                       failure=failure, behind=behind)
        if cached is not None:
            cached.bucket_plan = gathered.plan
        grads = (gather_grads(grad_inputs, holds_fulls, out_device, cap.bucket_bytes, receiver, collective_bytes,
                              posted, scope.meshes, behind) if grad_inputs else {})
    except BaseException as error:
        if posted.any:
            health.mark_part_way(groups, error)
        raise
    return gathered, grads


def _log_gathered(context: DTensorSummon, dtensors: list[DTensor], started: float) -> None:
    nbytes = sum(d.numel() * d.element_size() for d in dtensors)
    logger.debug(
        "summon_full_params(%s): %d tensors, %.1f MiB gathered in %.1f ms (rank0_only=%s, full tensors "
        "on this rank=%s)", module_label(context.module), len(dtensors), nbytes / 2**20,
        (time.perf_counter() - started) * 1e3, context.rank0_only, context._holds_fulls,
    )


def _scope_of_call(
    module: nn.Module, recurse: bool, writeback: bool, thread: int, modules: list[nn.Module] | None
) -> tuple[Scope, CachedSummon | None]:
    """What this call covers, leaving out what this thread's enclosing contexts hold; and the
    unit's cached summon, where it can have one (see [Note: summon cache] in ``_scope``)."""
    if not health.has_live_context(thread):
        return cached_scope(module, recurse, modules)
    mine, modules = enclosing_slots(module, recurse, thread, modules)  # ties made inside them too
    scope = collect_scope(module, recurse, mine, modules)
    if writeback:
        refuse_writeback_inside_no_writeback(module, [mine[key] for key in scope.enclosed])
    return scope, None


def _prepare(scope: Scope, resolved: list[DTensor], groups: list[SummonedGroup]) -> list[DTensor]:
    """FSDP2's groups in scope in a known state, all local; the DTensors to gather, in scope order.

    The root above them lazily initialised (see [Note: lazy init on entry]
    in ``_fsdp2``); then each group prepares itself (``SummonedGroup.prepare``):
    parameter resets adopted, units left unsharded resharded. ``resolved``:
    the DTensors as refusal resolved them, returned as they are unless a lazy
    init or an adoption ran, after which they are resolved again: FSDP2 may
    have adopted a replaced parameter. Resharding puts FSDP2's own sharded
    parameters back, the objects already resolved.

    [Note: units left unsharded]
    FSDP2 leaves the root unsharded after forward, and every unit with
    ``reshard_after_forward=False``. Such a unit in scope is resharded on entry,
    as FSDP2's own ``state_dict()`` does, and gathered from its sharded
    parameters: they are what the optimizer updates, while the unsharded copy
    may be stale (an optimizer step after a ``no_grad`` forward leaves the copy
    at the old values, and FSDP2's state cannot tell).
    The unit stays sharded when the context ends, and its next forward (or
    pre-backward) all-gathers again. FSDP1 instead keeps "storage behaviour the
    same as forward"; we do not, on evidence too: in plain FSDP2, with no shim
    involved, training that starts while a ``no_grad`` forward (eval,
    ``generate()``) has left units unsharded drifts from the reference, and is
    exact after ``reshard()`` (the figures: ``docs/semantics.md``).
    """
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
# Whatever chooses the collectives a call runs (whether it runs any, which
# tensors, in which buckets, whether it refuses) is computed from state every
# rank shares: the call's arguments, the module tree, FSDP2's state and
# DTensor specs, and the registry's record of enclosing contexts, which every
# rank keeps alike, holder of full tensors or not (``DTensorSummon._gather_and_install``).
# Never from what one rank holds: full tensors under ``rank0_only``, the
# contents of its slots, ``.grad``, a rank-local cache. The decisions, and
# what each reads:
# - *route* (``_common.route``, from ``summon``): the module tree (``is_fsdp1_tree``), FSDP2's units
#   and ownership, DTensor specs, and the registry (a slot a live summon holds,
#   or one holding a live summon's full or sharded tensor, a tie made inside,
#   counts as distributed on every rank, whatever this rank's slot holds);
# - *scope* (``_scope.collect_scope``, and nesting in ``_scope_of_call``): the
#   tree, FSDP2's ``FSDPParam``s, and the slots the registry says this
#   thread's enclosing contexts summoned or whose tensors they hold
#   (``_scope.enclosing_slots``). A nested call covered by them runs
#   no collective on any rank: holders see the outer call's full tensors, the
#   others what they saw in it (FSDP1's answer: its handle is already
#   summoning on every rank);
# - *refusals* (``_refusals``: ``validate_args``, ``refuse_before_anything``,
#   ``refuse_writeback_inside_no_writeback``): arguments, FSDP2's training
#   state, specs, the meta device, group health, the registry. Out-of-step
#   groups are the one rank-local record, by nature: the rank whose wait
#   failed is the one that knows (``docs/troubleshooting.md``);
# - *the summon cache* (``_scope.CachedSummon``): the tree and specs; a hit or
#   a miss changes host work only, never the plan it yields;
# - *who receives* (``_gather.layout.receivers_for_summon``): arguments and
#   FSDP2's shard ranks; ``holds_fulls``, its answer for this rank, decides
#   only local work (swap-in, marks, hooks), never a collective;
# - *buckets* (``_gather.layout.split_into_buckets``): specs, global shapes,
#   dtypes, devices and caps;
# - *gradients* (``_grads.agreed_grads``): the one input that is
#   rank-local, made shared by one small all-reduce before anything is
#   gathered (``_grads.agree_on_grads``), as FSDP1 does;
# - *the stream's batches* (``_stream.batch_params``): the tree, FSDP2's
#   owners, and the registry for slots a live summon holds.
# Exit and writeback run no collective: they may, and do, judge by what this
# rank holds. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns any divergence into an
# error at the first mismatched collective; CI runs the suite once under it.

# [Note: hot path]
# The per-unit weight-sync loop enters one summon a unit, so on NCCL a warm
# summon's host time is what users wait for (figures: ``docs/host-cost.md``;
# ``scripts/fake_bench.py`` measures it on the fake backend). The shortcuts
# taken for it, each where it is made, each kept only while that script
# shows it pays:
# - an unchanged unit's scope and bucket plan are cached ([Note: summon
#   cache] in ``_scope``), and each DTensor spec's layout (``_gather.layout``);
# - a unit is gathered in one collective a dtype, as ``unshard()`` does;
# - ``DTensorSummon`` is a slotted class, not a generator and an
#   ``ExitStack``; its ``SummonedParam``s are made by one ``map``;
# - the engine's ``no_grad``: the C switch itself, twice a gather;
# - a context's root state is found in O(1): FSDP2's lazy init lists it
#   first (``_fsdp2``);
# - ``_health.Call.any`` is a class attribute, the registry dicts and counters.
