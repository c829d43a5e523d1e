"""Issue 50's fault-injection sweep: an exception at any call the shim makes changes nothing (2 gloo ranks).

The rule: whatever is interrupted, at any point, with any ``BaseException``,
leaves the model (every slot's object, dtype and bits), the shards (bit for
bit, unless a writeback was asked and completed, all of it), FSDP2's state
(each group's ``_sharded_state``, ``post_forward_mesh_info`` and training
state, each state's training state, each parameter's sharded state), grad
mode, module hooks (every hook dict of every module, and torch's global
module hooks, by id and by hook), the modules' instance attributes
(``_apply`` and the rest of ``__dict__``) and the registry exactly as if the
interrupted step had not started, and the caller sees its own exception
(the very object raised, not a secondary error). And after each fault, on
the same process group, a fresh summon writes an edit back and a training
step equals an unsharded reference's, bit for bit.

How: ``sys.settrace`` (no mocks). A first pass per phase records, in call
order, every ``fsdp_shim`` function (by file and qualified name) that the
phase calls:

* ``enter``: ``fsdp_shim.summon_full_params(model, writeback=True)`` and its ``__enter__``;
* ``forward/no_grad`` and ``forward/grad``: ``model(tokens)`` inside such a summon;
* ``exit``: its ``__exit__`` after an edit of one weight.

Then, for each function every rank called, and each exception
(``KeyboardInterrupt``, an out-of-memory error, a ``RuntimeError``), the
phase runs again with the trace function raising that exception at the
``call`` event of the function's first call (and of its second, where every
rank calls it more than once: a fault part way through a sequence of casts),
on every rank alike; an exception raised by a trace function propagates
into that frame. The state is checked against a capture made just before
the phase (inside the context too, for a forward), then the follow-up runs.
All cases of one configuration (with and without a
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``) run in one 2-rank job
on one process group; every failing (phase, function, exception) case is
reported in one assertion message. After a case that left damage behind
(or whose follow-up failed) the model is rebuilt from the reference, on the
same process group, and leaked global hooks and registry entries are
dropped, so that the cases after it start clean. The model: the suite's
``TinyLM`` with one block, so two FSDP2 units (the root, with the tied
embedding, and the block). ``FSDP_SHIM_SWEEP_PROGRESS=1`` prints each case
as it starts (rank 0).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.modules.module as module_globals
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_shim
from _faults import local_shards, short_timeout_mesh
from _helpers import LMConfig, build_lm, rank, shard_lm, snapshot, tokens_for
from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _health, _registry
from fsdp_shim.tools.launch import report_progress

CONFIG = LMConfig(layers=1)  # two FSDP2 units (the root and a block): every "second" a sweep needs, at half the cost
LR = 0.01
#: The out-of-memory error: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` before torch 2.5).
OOM: type[BaseException] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
EXCEPTIONS: dict[str, type[BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt, "OutOfMemoryError": OOM, "RuntimeError": RuntimeError,
}
PHASES = ("enter", "forward/no_grad", "forward/grad", "exit")
#: The line sweep's phases: entry with and without ``with_grads`` (its agreement), a forward inside (under a bf16
#: policy: its casts), exit, and a bf16 stream.
LINE_PHASES = ("enter", "enter/with_grads", "forward/grad", "exit", "stream")
#: Every how many line events the README's suite injects (CI's whole sweep sets ``FSDP_SHIM_LINE_STRIDE=1``).
LINE_STRIDE = 23
#: Lines no library can shield: ``DTensorSummon.__exit__``'s own first lines, before its ``try``.
UNSHIELDABLE_LINES = ("DTensorSummon.__exit__:+1", "DTensorSummon.__exit__:+3", "DTensorSummon.__exit__:+4")
#: One configuration's sweep takes about 30 s (no policy) and 55 s (bf16) on two idle cores; a loaded
#: machine takes several times longer, and the pool's default 120 s would cut it short.
SWEEP_TIMEOUT_S = 540
#: Which calls of a function to inject at: its first, and its second where every rank makes one (the
#: second unit's hooks, the second of a sequence of casts, records or swaps).
NTHS = (1, 2)
#: Calls no library can shield: an exception at the call of ``__exit__`` itself reaches the ``with``
#: statement before any of its code runs (``[Note: exit always restores]`` in ``fsdp_shim/_summon.py``).
UNSHIELDABLE = {("exit", "fsdp_shim/_summon.py:DTensorSummon.__exit__", 1)}

_PACKAGE = os.path.dirname(os.path.abspath(fsdp_shim.__file__)) + os.sep
_ROOT = os.path.dirname(_PACKAGE.rstrip(os.sep)) + os.sep


def _function_key(code: Any) -> str | None:
    """``fsdp_shim/_summon.py:DTensorSummon.__enter__`` for a code object of the package, else None
    (lambdas, comprehensions and other nameless code also get their first line)."""
    filename = code.co_filename
    if not filename.startswith(_PACKAGE):
        return None
    key = f"{filename[len(_ROOT):]}:{getattr(code, 'co_qualname', code.co_name)}"  # co_qualname: Python 3.11+
    return f"{key}:{code.co_firstlineno}" if "<" in code.co_name else key


#: The target of a line-granularity case: the ``nth`` line event of package code, counted across the phase.
LINE = "line"


class _Trace:
    """A ``sys.settrace`` function: counts the package's calls (in first-call order) and raises ``error``
    at the ``call`` event of the ``nth`` call of ``target`` (CPython then unsets the trace function).
    With ``lines``, it records where each line event of package code was (``where``); with ``target=LINE``,
    it raises at the ``nth`` line event at ``at`` (``Class.function:+offset``): between two statements, as an
    asynchronous signal can, at the same place on every rank (the ranks' line counts differ where their
    shards do)."""

    def __init__(self, target: str | None = None, nth: int = 1, error: BaseException | None = None,
                 lines: bool = False, at: str | None = None):
        self.target, self.nth, self.error = target, nth, error
        self.calls: dict[str, int] = {}
        self.fired = False
        self._keys: dict[Any, str | None] = {}
        self._lines, self.at = lines or target == LINE, at
        self.lines = 0
        self.where: list[str] = []

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            code = frame.f_code
            where = f"{getattr(code, 'co_qualname', code.co_name)}:+{frame.f_lineno - code.co_firstlineno}"
            if self.error is None:
                self.where.append(where)
            elif where == self.at:
                self.lines += 1
                if self.lines == self.nth and not self.fired:
                    self.fired = True
                    raise self.error
        return self._line

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return None
        code = frame.f_code
        try:
            key = self._keys[code]
        except KeyError:
            key = self._keys[code] = _function_key(code)
        if key is None:
            return None
        n = self.calls[key] = self.calls.get(key, 0) + 1
        if n == self.nth and key == self.target and not self.fired:
            self.fired = True
            raise self.error  # type: ignore[misc]  # set where target is
        return self._line if self._lines else None

    def __enter__(self) -> _Trace:
        sys.settrace(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


# --------------------------------------------------------------------------- state: capture and compare
def _hook_dicts(owner: dict[str, Any]) -> dict[str, tuple[tuple[Any, int], ...]]:
    """Every hook dict among ``owner``'s values: its keys, and each hook by identity."""
    return {name: tuple((key, id(hook)) for key, hook in value.items())
            for name, value in owner.items() if "hook" in name and isinstance(value, dict)}


def _fsdp_states(model: nn.Module) -> list[Any]:
    out = []
    for name, module in model.named_modules():
        state = fsdp2.fsdp_state_of(module)
        if state is not None and state not in [s for _, s in out]:
            out.append((name or "<root>", state))
    return out


def _capture(model: nn.Module) -> dict[str, Any]:
    """Everything the rule names, as it is now (``snapshot``: slots, gradients and FSDP2's group state)."""
    modules = dict(model.named_modules())
    return {
        "snapshot": snapshot(model),
        "shards": local_shards(model),
        "hooks": {name: _hook_dicts(vars(m)) for name, m in modules.items()},
        "globals": _hook_dicts({name: value for name, value in vars(module_globals).items()
                                if name.startswith("_global_")}),
        "attrs": {name: dict(vars(m)) for name, m in modules.items()},
        "fsdp": [(name, state._training_state, [(fp._module_info.param_name, fp.sharded_state)
                                                for g in fsdp2.param_groups(state) for fp in g.fsdp_params])
                 for name, state in _fsdp_states(model)],
        "grad_enabled": torch.is_grad_enabled(),
        "registry": (list(_registry._live), dict(_health._claims)),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.contiguous().view(torch.uint8) if t.numel() else t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _describe(value: object) -> str:
    if isinstance(value, DTensor):
        return f"DTensor {value.dtype}"
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} {value.dtype}"
    return type(value).__name__


def _same_value(a: object, b: object) -> bool:
    return a is b or (type(a) in (int, float, str, bool, tuple) and type(a) is type(b) and a == b)


def _diff(before: dict[str, Any], after: dict[str, Any], *, written: dict[str, torch.Tensor] | None = None,
          values: bool = True) -> tuple[list[str], bool]:
    """What differs between two captures, as symptoms; and whether the shards hold ``written``
    (the edited shards a completed writeback leaves: all of them, or none). ``values=False``: all
    but the values of slots and shards (what a training step changes)."""
    out: list[str] = []
    slots_before, slots_after = before["snapshot"]["slots"], after["snapshot"]["slots"]
    if slots_before.keys() != slots_after.keys():
        out.append(f"slots appeared or went: {sorted(slots_before.keys() ^ slots_after.keys())}")
    replaced, edited, grads = [], [], []
    for key in [k for k in slots_before if k in slots_after]:
        p, value, grad, _ = slots_before[key]
        q, value2, grad2, _ = slots_after[key]
        if q is not p:
            replaced.append(f"{key.lstrip('.')} ({_describe(q)}; was {_describe(p)})")
        elif values and not isinstance(p, DTensor) and not _same_bits(value, value2):
            edited.append(key.lstrip("."))
        if grad2 is not grad:
            grads.append(f"{key.lstrip('.')} ({_describe(grad2)}; was {_describe(grad)})")
    for what, found in (("hold another object", replaced), ("hold other values", edited),
                        ("have another .grad", grads)):
        if found:
            out.append(f"{len(found)} slot(s) {what}: {', '.join(found[:2])}{', ...' if len(found) > 2 else ''}")

    shards_before, shards_after = before["shards"], after["shards"]
    changed, wrong = [], []
    for name, (param, shard) in shards_before.items():
        now = shards_after.get(name)
        if now is None or now[0] is not param:
            out.append(f"FSDP2's sharded parameter {name} replaced")
            continue
        if values and not _same_bits(shard, now[1]):
            changed.append(name)
            if written is None or name not in written or not _same_bits(written[name], now[1]):
                wrong.append(name)
    completed = bool(written) and set(changed) == set(written) and not wrong
    if changed and not completed:
        what = "written back in part" if written and set(changed) < set(written) and not wrong else "changed"
        out.append(f"shard bits {what}: {', '.join(sorted(changed)[:4])}{' ...' if len(changed) > 4 else ''}")

    groups_before, groups_after = before["snapshot"]["groups"], after["snapshot"]["groups"]
    for (g, s, m, t), (g2, s2, m2, t2) in zip(groups_before, groups_after, strict=False):
        label = type(fsdp2.group_modules(g)[0]).__name__ if g is g2 else "?"
        if g2 is not g:
            out.append("FSDP2 param group replaced")
        if s2 != s:
            out.append(f"FSDP2 group {label}: _sharded_state {s.name} -> {s2.name}")
        if m2 is not m and m2 != m:
            out.append(f"FSDP2 group {label}: post_forward_mesh_info {type(m).__name__} -> {type(m2).__name__}")
        if t2 != t:
            out.append(f"FSDP2 group {label}: _training_state {t.name} -> {t2.name}")
    if len(groups_before) != len(groups_after):
        out.append("FSDP2 param groups appeared or went")
    for (name, t, params), (_, t2, params2) in zip(before["fsdp"], after["fsdp"], strict=False):
        if t2 != t:
            out.append(f"FSDP2 state {name}: _training_state {t.name} -> {t2.name}")
        moved = [f"{p}: {s.name} -> {s2.name}" for (p, s), (_, s2) in zip(params, params2, strict=False) if s2 != s]
        if moved:
            out.append(f"FSDP2 state {name}: sharded_state {'; '.join(moved[:3])}")

    hook_changes: dict[str, list[str]] = {}
    for module_name, hooks in before["hooks"].items():
        hooks2 = after["hooks"].get(module_name, {})
        for attr in sorted(hooks.keys() | hooks2.keys()):
            old, new = hooks.get(attr, ()), hooks2.get(attr, ())
            if old != new:
                how = f"{len(new) - len(old):+d}" if len(old) != len(new) else "swapped"
                hook_changes.setdefault(f"{attr} {how}", []).append(module_name or "<root>")
    for attr in sorted(before["globals"].keys() | after["globals"].keys()):
        old, new = before["globals"].get(attr, ()), after["globals"].get(attr, ())
        if old != new:
            how = f"{len(new) - len(old):+d}" if len(old) != len(new) else "swapped"
            hook_changes.setdefault(f"global {attr} {how}", []).append("torch.nn.modules.module")
    for change, where in hook_changes.items():
        out.append(f"hooks: {change} on {', '.join(where[:3])}{f' (+{len(where) - 3} more)' if len(where) > 3 else ''}")

    attr_changes: dict[str, list[str]] = {}
    for module_name, attrs in before["attrs"].items():
        attrs2 = after["attrs"].get(module_name, {})
        gained = sorted(attrs2.keys() - attrs.keys())
        lost = sorted(attrs.keys() - attrs2.keys())
        swapped = sorted(k for k in attrs.keys() & attrs2.keys() if not _same_value(attrs[k], attrs2[k]))
        for what, names in (("gained", gained), ("lost", lost), ("changed", swapped)):
            if names:
                attr_changes.setdefault(f"{what} {', '.join(names)}", []).append(module_name or "<root>")
    for change, where in attr_changes.items():
        out.append(f"module __dict__ {change} on {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}")

    if after["grad_enabled"] != before["grad_enabled"]:
        out.append(f"grad mode {before['grad_enabled']} -> {after['grad_enabled']}")
    if after["registry"] != before["registry"]:
        (live, claims), (live0, claims0) = after["registry"], before["registry"]
        out.append(f"registry: {len(live)} live context(s), {len(claims)} claim(s) (was {len(live0)}, {len(claims0)})")
    return out, completed


def _error_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def _chain(error: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


# --------------------------------------------------------------------------- the model, the reference, a step
def _sharded_like(ref: nn.Module, mesh: Any, policy: MixedPrecisionPolicy | None) -> nn.Module:
    """A sharded model whose shards hold ``ref``'s values (no collective: each rank copies its chunk)."""
    model = shard_lm(build_lm(CONFIG), mesh, mp_policy=policy)
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            p._local_tensor.copy_(_chunk(r, p))
    return model


def _chunk(full: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's dim-0 chunk of ``full``, as FSDP2 shards it (``torch.chunk``)."""
    chunks = torch.chunk(full.detach(), sharded.device_mesh.size(), dim=0)
    index = sharded.device_mesh.get_local_rank()
    return chunks[index] if index < len(chunks) else full.detach()[:0]


def _against_ref(model: nn.Module, ref: nn.Module, when: str) -> list[str]:
    wrong = []
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if not isinstance(p, DTensor):
            wrong.append(f"{name} ({_describe(p)})")
        elif not _same_bits(p._local_tensor, _chunk(r, p)):
            wrong.append(name)
    return [f"{when}: differs from the reference at {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"
            ] if wrong else []


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _step(model: nn.Module, tokens: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # stateless: a new one each step is the same
    _loss(model(tokens)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


#: The reference's cast copy, per reference (one per sweep): made once, its values refreshed each step.
_low_copies: dict[int, nn.Module] = {}


def _ref_step(ref: nn.Module, tokens: torch.Tensor, policy: MixedPrecisionPolicy | None) -> None:
    """The unsharded step FSDP2 takes: under a ``param_dtype``, forward and backward on a cast copy, then
    the gradients (identical on every rank, so their average is exact) cast back onto the fp32 masters."""
    if policy is None:
        _step(ref, tokens)
        return
    low = _low_copies.get(id(ref))
    if low is None:
        low = _low_copies[id(ref)] = copy.deepcopy(ref).to(policy.param_dtype)  # deepcopy keeps the tie
    with torch.no_grad():
        for p, q in zip(ref.parameters(), low.parameters(), strict=True):
            q.copy_(p)
            q.grad = None
    _loss(low(tokens)).backward()
    for p, q in zip(ref.parameters(), low.parameters(), strict=True):
        p.grad = q.grad.to(p.dtype)
    optimizer = torch.optim.SGD(ref.parameters(), lr=LR)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _follow_up(model: nn.Module, ref: nn.Module, tokens: torch.Tensor, policy: MixedPrecisionPolicy | None,
               mesh: Any = None) -> list[str]:
    """A fresh summon that edits one weight and writes it back, then a training step: both on the same
    process group, each against the reference bit for bit."""
    out = []
    try:
        with fsdp_shim.summon_full_params(model, writeback=True), torch.no_grad():
            model.blocks[-1].fc2.weight.mul_(-1.0)
    except BaseException as error:  # noqa: BLE001  # a symptom, reported with the others
        if not (mesh is not None and _left_part_way(mesh) and "left a gather part way" in str(error)):
            out.append(f"a fresh summon raised {_error_text(error)}")  # then the reference stays unedited too
    else:
        with torch.no_grad():
            ref.blocks[-1].fc2.weight.mul_(-1.0)
    out += _against_ref(model, ref, "after a fresh summon's writeback")
    try:
        with torch.enable_grad():  # grad mode left off is a symptom of its own, found by the capture
            _step(model, tokens)
    except BaseException as error:  # noqa: BLE001
        out.append(f"a training step raised {_error_text(error)}")
    with torch.enable_grad():
        _ref_step(ref, tokens, policy)
    out += _against_ref(model, ref, "after a training step")
    return out


def _left_part_way(mesh: Any) -> bool:
    """Whether a fault left a gather over the model's group part way on this rank: then the group is
    refused at once, by design (issue 51: its peers' collectives could pair with the next call's), and
    the sweep goes on on a new group. Every rank faulted alike here, so every rank knows alike."""
    return mesh.get_group() in _health._out_of_step


# --------------------------------------------------------------------------- one phase, one case
def _run_phase(phase: str, model: nn.Module, ref: nn.Module, tokens: torch.Tensor, trace: _Trace,
               ) -> tuple[BaseException | None, bool, list[str]]:
    """Run ``phase`` once under ``trace``; check the state. Returns what reached the caller, whether
    the phase completed, and the symptoms."""
    before = _capture(model)
    caught: BaseException | None = None
    symptoms: list[str] = []
    if phase == "stream":
        try:
            with trace:
                for _ in fsdp_shim.iter_full_params(model, dtype=torch.bfloat16, rank0_only=False):
                    pass
        except BaseException as error:  # noqa: BLE001  # the injected one, KeyboardInterrupt included
            caught = error
        found, _ = _diff(before, _capture(model))
        symptoms += found
    elif phase.startswith("enter"):
        entered = None
        try:
            with trace:
                summon = fsdp_shim.summon_full_params(model, writeback=True, with_grads=phase == "enter/with_grads")
                summon.__enter__()
                entered = summon
        except BaseException as error:  # noqa: BLE001  # the injected one, KeyboardInterrupt included
            caught = error
        if entered is not None:  # entry went through: finish the context, nothing edited
            try:
                entered.__exit__(None, None, None)
            except BaseException as error:  # noqa: BLE001
                symptoms.append(f"exit after the entry raised {_error_text(error)}")
        found, _ = _diff(before, _capture(model))
        symptoms += found
    elif phase.startswith("forward"):
        summon = fsdp_shim.summon_full_params(model, writeback=True)
        summon.__enter__()
        try:
            inside = _capture(model)
            mode = torch.no_grad if phase == "forward/no_grad" else torch.enable_grad
            try:
                with mode(), trace:
                    model(tokens)
            except BaseException as error:  # noqa: BLE001
                caught = error
            found, _ = _diff(inside, _capture(model))
            symptoms += [f"inside, after the forward: {s}" for s in found]
        finally:
            try:
                summon.__exit__(None, None, None)
            except BaseException as error:  # noqa: BLE001
                symptoms.append(f"exit after the forward raised {_error_text(error)}")
        found, _ = _diff(before, _capture(model))  # nothing was edited: nothing may be written
        symptoms += found
    else:
        summon = fsdp_shim.summon_full_params(model, writeback=True)
        summon.__enter__()
        with torch.no_grad():
            model.norm.weight.mul_(-1.0)
        try:
            with trace:
                summon.__exit__(None, None, None)
        except BaseException as error:  # noqa: BLE001
            caught = error
        written = {"norm.weight": before["shards"]["norm.weight"][1].neg()}
        found, completed = _diff(before, _capture(model), written=written)
        symptoms += found
        if completed:
            with torch.no_grad():
                ref.norm.weight.mul_(-1.0)
        elif trace.error is None:
            symptoms.append("the edit was not written back")
    return caught, caught is None, symptoms


def _verdict(trace: _Trace, caught: BaseException | None) -> list[str]:
    """Whether the caller saw its own exception."""
    if not trace.fired:
        return ["not reached: the function was not called this time"]
    if caught is None:
        return ["swallowed: the phase completed, the caller never saw the exception"]
    if caught is trace.error:
        return []
    chained = " (the injected one in its chain)" if trace.error in _chain(caught) else ""
    return [f"the caller saw {_error_text(caught)}{chained}"]


def _drop_leaks(baseline_globals: dict[str, dict[Any, Any]]) -> None:
    """After a failing case: global hooks it left, registry entries and grad mode, as before the sweep."""
    for name, hooks in vars(module_globals).items():
        if name.startswith("_global_") and isinstance(hooks, dict) and name in baseline_globals:
            for key in [k for k in hooks if k not in baseline_globals[name]]:
                del hooks[key]
    _registry._live.clear()
    _health._claims.clear()
    torch._C._set_grad_enabled(True)


def _line_cases(every_rank: list[Any], phases: tuple[str, ...]) -> list[tuple[str, str, int, str]]:
    """Line-granularity cases: every ``LINE_STRIDE``-th line event of each phase that every rank reaches
    (``FSDP_SHIM_LINE_STRIDE``: 1 in CI's whole sweep), ``KeyboardInterrupt`` on every rank alike, but for
    the first lines of ``DTensorSummon.__exit__``, before its ``try`` (``UNSHIELDABLE``)."""
    stride = int(os.environ.get("FSDP_SHIM_LINE_STRIDE", LINE_STRIDE))
    cases = []
    for phase in phases:
        where = every_rank[0][phase]
        for i in range(stride // 2, len(where), stride):
            at = where[i]
            nth = where[:i + 1].count(at)  # its nth time there: a place every rank reaches alike
            if not at.startswith(UNSHIELDABLE_LINES) and all(r[phase].count(at) >= nth for r in every_rank):
                cases.append((phase, f"{LINE} {at}", nth, "KeyboardInterrupt"))
    return cases


def rank_sweep(param_dtype: str | None, granularity: str = "call") -> dict[str, Any]:
    started = time.monotonic()
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype)) if param_dtype else None
    mesh = short_timeout_mesh(20.0)  # a case that made the ranks disagree times out, not the whole job
    tokens = tokens_for(CONFIG)
    ref = build_lm(CONFIG)
    model = _sharded_like(ref, mesh, policy)
    baseline_globals = {name: dict(value) for name, value in vars(module_globals).items()
                        if name.startswith("_global_") and isinstance(value, dict)}
    problems = _follow_up(model, ref, tokens, policy)  # the first summon and step: caches and lazy init warm
    assert not problems, f"the sweep's own baseline fails: {problems}"

    # 1. record: every package function each phase calls, in first-call order, on every rank (or every line)
    lines = granularity == "line"
    phases = LINE_PHASES if lines else PHASES
    recorded: dict[str, Any] = {}
    for phase in phases:
        if lines:  # once untraced first: lines run only the first time (lazy imports) are not places to inject
            _run_phase(phase, model, ref, tokens, _Trace())
            assert not _follow_up(model, ref, tokens, policy)
        trace = _Trace(lines=lines)
        caught, _, symptoms = _run_phase(phase, model, ref, tokens, trace)
        assert caught is None and not symptoms, f"{phase} fails with no fault injected: {caught!r} {symptoms}"
        assert not _follow_up(model, ref, tokens, policy)
        recorded[phase] = trace.where if lines else trace.calls
    clean = _capture(model)  # what is left after a case, but for values, unless the case broke something
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, recorded, group=mesh.get_group())

    # 2. inject: each function every rank calls, each exception, first (and second) call
    cases, one_sided = ([], []) if not lines else (_line_cases(every_rank, phases), [])
    for phase in () if lines else phases:
        for key in recorded[phase]:
            counts = [r[phase].get(key, 0) for r in every_rank]
            if len(set(counts)) > 1:  # some ranks call it less often: listed, and injected only at calls all make
                one_sided.append(f"{phase} {key} {counts}")
            for nth in NTHS:
                if nth <= min(counts) and (phase, key, nth) not in UNSHIELDABLE:
                    cases += [(phase, key, nth, name) for name in EXCEPTIONS]
    failures: list[tuple[str, str, int, str, list[str]]] = []
    groups_made = 0
    report_progress(f"interrupt sweep (param_dtype={param_dtype}): {len(cases)} cases, "
                    f"{time.monotonic() - started:.1f} s in")
    for index, (phase, key, nth, name) in enumerate(cases):
        if os.environ.get("FSDP_SHIM_SWEEP_PROGRESS"):
            report_progress(f"{index} {phase} {key} {nth} {name} {time.monotonic() - started:.1f} s")
        error = EXCEPTIONS[name](f"injected at call {nth} of {key}")
        trace = _Trace(LINE, nth, error, at=key[len(LINE) + 1:]) if key.startswith(LINE) else _Trace(key, nth, error)
        try:
            caught, _, symptoms = _run_phase(phase, model, ref, tokens, trace)
            symptoms = _verdict(trace, caught) + symptoms
        except BaseException as unexpected:  # noqa: BLE001  # the sweep itself tripped: report, go on
            symptoms = [f"the case itself raised {_error_text(unexpected)}"]
        follow_up = _follow_up(model, ref, tokens, policy, mesh)
        symptoms += follow_up
        if symptoms:
            failures.append((phase, key, nth, name, list(dict.fromkeys(symptoms))))
        damage, _ = _diff(clean, _capture(model), values=False)
        part_way = _left_part_way(mesh)
        if lines:  # a new group is a collective: made where any rank left a gather part way (they may differ)
            flag = torch.tensor([int(part_way)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            part_way = bool(flag.item())
        if follow_up or damage or part_way:  # the next case starts from a clean model
            _drop_leaks(baseline_globals)
            if part_way:  # the group is refused from now on: a new one (see ``_left_part_way``)
                mesh = short_timeout_mesh(20.0)
                groups_made += 1
            model = _sharded_like(ref, mesh, policy)
            problems = _follow_up(model, ref, tokens, policy)
            assert not problems, f"the model rebuilt after {phase} {key} {name} fails: {problems}"
            clean = _capture(model)
    return {
        "rank": rank(),
        "functions": {phase: list(recorded[phase]) for phase in phases},
        "cases": len(cases),
        "one_sided": one_sided,
        "failures": failures,
        "seconds": round(time.monotonic() - started, 1),
        "groups_left_part_way": groups_made,
    }


def _report(param_dtype: str | None, results: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """Every failing case once, with each rank's symptoms (once where every rank saw the same)."""
    by_case: dict[tuple[str, str, int, str], dict[int, list[str]]] = {}
    for result in results:
        for phase, key, nth, name, symptoms in result["failures"]:
            by_case.setdefault((phase, key, nth, name), {})[result["rank"]] = symptoms
    lines = []
    config = f"param_dtype={param_dtype or 'none'}"
    for (phase, key, nth, name), per_rank in by_case.items():
        distinct = {tuple(s) for s in per_rank.values()}
        if len(distinct) == 1 and len(per_rank) == len(results):
            detail = "; ".join(next(iter(distinct)))
        else:
            detail = " | ".join(f"rank {r}: {'; '.join(s)}" for r, s in sorted(per_rank.items()))
        lines.append(f"{config} {phase} {key} (call {nth}) {name}: {detail}")
    return results[0]["cases"], lines


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"], ids=["no-policy", "bf16-policy"])
def test_an_exception_at_any_call_changes_nothing(dist_run, param_dtype):
    results = dist_run(2, rank_sweep, param_dtype, timeout_s=SWEEP_TIMEOUT_S)
    cases, failing = _report(param_dtype, results)
    functions = results[0]["functions"]
    assert all(len(functions[phase]) >= 3 for phase in PHASES), functions  # the sweep reaches each phase
    print(f"\n{cases} cases ({results[0]['seconds']} s); functions per phase: "
          f"{ {phase: len(keys) for phase, keys in functions.items()} }; one-sided: {results[0]['one_sided']}")
    assert not failing, f"{len(failing)} of {cases} cases fail:\n" + "\n".join(failing)


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"], ids=["no-policy", "bf16-policy"])
def test_an_interrupt_between_any_two_statements_changes_nothing(dist_run, param_dtype):
    """Issue 58: ``KeyboardInterrupt`` at line events of package code (every ``LINE_STRIDE``-th here, every one
    with ``FSDP_SHIM_LINE_STRIDE=1``), on every rank alike: what a real Ctrl-C reaches after a call returns."""
    stride = int(os.environ.get("FSDP_SHIM_LINE_STRIDE", LINE_STRIDE))
    results = dist_run(2, rank_sweep, param_dtype, "line", timeout_s=SWEEP_TIMEOUT_S * max(1, LINE_STRIDE // stride))
    cases, failing = _report(param_dtype, results)
    functions = results[0]["functions"]
    assert all(len(functions[phase]) >= 30 for phase in LINE_PHASES), {p: len(w) for p, w in functions.items()}
    print(f"\n{cases} cases ({results[0]['seconds']} s); functions per phase: "
          f"{ {phase: len(keys) for phase, keys in functions.items()} }; one-sided: {results[0]['one_sided']}")
    assert not failing, f"{len(failing)} of {cases} cases fail:\n" + "\n".join(failing)
