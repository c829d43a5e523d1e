"""Record before acting: an interrupt between two statements changes nothing (issue 58, D2 to D6, D8; D9).

Each test raises ``KeyboardInterrupt`` at one place a real Ctrl-C can reach: a
line event right after a call returns, or part way through a loop. The place
is found by what the code calls (``_interrupt_after_return``) or by the n-th
line a function runs (``_interrupt_at_line``), so the same test runs on
0.16.0, where each fails, and now. ``tests/test_interrupts.py``'s line sweep
covers every line alike; these name each defect once. 2 gloo ranks, real
process groups, exact references.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_shim
from _faults import assert_untouched, local_shards, with_grads_on_a_short_timeout
from _helpers import LMConfig, build_lm, counting_collectives, patched, shard_lm, tokens_for
from fsdp_shim import _grads, _health, _param, _registry, _stream, _summon
from fsdp_shim._gather import engine

CONFIG = LMConfig(layers=2)


@contextlib.contextmanager
def _interrupt_after_return(callee: Callable[..., Any], caller: Callable[..., Any], nth: int = 1,
                            ) -> Iterator[list[bool]]:
    """Raise ``KeyboardInterrupt`` in ``caller``'s frame at its first line event after its ``nth`` call of
    ``callee`` returned: where a signal that arrived during the call is raised. Yields ``[fired]``."""
    callee_code, caller_code = callee.__code__, caller.__code__
    state: dict[str, Any] = {"returns": 0, "armed": None}
    fired = [False]

    def in_callee(frame, event, arg):
        if event == "return" and frame.f_back is not None and frame.f_back.f_code is caller_code:
            state["returns"] += 1
            if state["returns"] == nth:
                state["armed"] = frame.f_back
        return in_callee

    def in_caller(frame, event, arg):
        if event == "line" and frame is state["armed"] and not fired[0]:
            fired[0] = True
            raise KeyboardInterrupt(f"right after {callee.__qualname__} returned to {caller.__qualname__}")
        return in_caller

    def calls(frame, event, arg):
        if frame.f_code is callee_code:
            return in_callee
        if frame.f_code is caller_code:
            return in_caller
        return None

    sys.settrace(calls)
    try:
        yield fired
    finally:
        sys.settrace(None)


@contextlib.contextmanager
def _interrupt_at_line(function: Callable[..., Any], nth: int, when: Callable[[], bool] = lambda: True,
                       ) -> Iterator[list[bool]]:
    """Raise ``KeyboardInterrupt`` at the ``nth`` line event of ``function``'s frames for which ``when()``
    holds. Yields ``[fired]``."""
    code = function.__code__
    seen = [0]
    fired = [False]

    def in_function(frame, event, arg):
        if event == "line" and not fired[0] and when():
            seen[0] += 1
            if seen[0] == nth:
                fired[0] = True
                raise KeyboardInterrupt(f"line event {nth} of {function.__qualname__}")
        return in_function

    sys.settrace(lambda frame, event, arg: in_function if frame.f_code is code else None)
    try:
        yield fired
    finally:
        sys.settrace(None)


def _refused_at_once(model) -> str:
    started = time.monotonic()
    with patched(), counting_collectives() as counts, pytest.raises(fsdp_shim.GroupOutOfStepError) as refused:
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            raise AssertionError("the body ran")
    assert counts == {} and time.monotonic() - started < 2.5, (counts, "waited instead of refusing at once")
    return str(refused.value)


def _one_rank_interrupted_after(callee: Callable[..., Any], caller: Callable[..., Any]) -> str:
    """A ``with_grads`` summon on a short timeout, interrupted on one rank right after ``caller``'s call of
    ``callee`` returned; the others fail on the timeout. Nothing changed; what the next summon says."""
    model, before, faulty = with_grads_on_a_short_timeout(CONFIG)
    injected = _interrupt_after_return(callee, caller) if faulty else contextlib.nullcontext([True])
    with patched(), injected as fired, pytest.raises(KeyboardInterrupt if faulty else RuntimeError):
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            raise AssertionError("the body ran")
    assert fired[0]
    assert_untouched(model, before)
    return _refused_at_once(model)


def rank_d2_an_interrupt_right_after_the_gradients_agreement_is_refused_at_once() -> str:
    """D2: the faulting rank was left unmarked, and its retry waited out the group's timeout."""
    return _one_rank_interrupted_after(dist.all_reduce, _grads.agree_on_grads)


@pytest.mark.one_sided
@pytest.mark.parametrize("world", [2, 3])  # 3: uneven shards
def test_d2_an_interrupt_right_after_the_gradients_agreement_is_refused_at_once(dist_run, world):
    words = dist_run(world, rank_d2_an_interrupt_right_after_the_gradients_agreement_is_refused_at_once)
    assert all("out of step" in text for text in words), words


def rank_an_interrupt_right_after_the_gradients_are_agreed_marks_the_group() -> str:
    """After D2: the gradients' agreement returned on every rank, then the interrupt landed in the entry before
    the parameters' gather began: the other ranks gather on, so this rank must mark its groups (0.17.0 did not:
    its next summon's collective paired with their stale all-gather, and gloo aborted the peer)."""
    return _one_rank_interrupted_after(_grads.agreed_grads, _summon.DTensorSummon._gather_and_install)


@pytest.mark.one_sided
def test_an_interrupt_right_after_the_gradients_are_agreed_marks_the_group(dist_run):
    words = dist_run(2, rank_an_interrupt_right_after_the_gradients_are_agreed_marks_the_group)
    assert all("out of step" in text for text in words), words


def rank_d3_an_interrupt_while_a_forward_places_its_casts_writes_no_rounding() -> bool:
    """D3: a cast placed before the group recorded it was missed by the put-back, and a ``writeback=True``
    exit wrote its bf16 rounding into the fp32 masters."""
    model = shard_lm(build_lm(CONFIG), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    tokens = tokens_for(CONFIG)
    with patched():
        model(tokens)  # FSDP2's lazy init, outside the sweep
        before = local_shards(model)
        with FSDP.summon_full_params(model, writeback=True):
            with _interrupt_at_line(_param._place, nth=4) as fired, pytest.raises(KeyboardInterrupt):
                model(tokens)  # the first parameter's slot holds its cast when the interrupt lands
            assert fired[0]
            assert all(p.dtype == torch.float32 for p in model.parameters()), "a cast outlived its forward"
    assert_untouched(model, before)  # nothing edited: nothing written back, bit for bit
    return True


def test_d3_an_interrupt_while_a_forward_places_its_casts_writes_no_rounding(dist_run):
    assert dist_run(2, rank_d3_an_interrupt_while_a_forward_places_its_casts_writes_no_rounding) == [True, True]


def _in_another_thread(call: Callable[[], Any]) -> str:
    said: list[str] = []

    def run() -> None:
        try:
            call()
            said.append("ran")
        except RuntimeError as error:
            said.append(str(error))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return said[0]


def rank_d4_an_interrupt_right_after_a_claim_leaks_no_claim(caller: str) -> str:
    """D4: a claim made and not yet recorded leaked: every other thread's summon or stream on the group was
    refused "another thread has a context open" for the life of the process."""
    model = shard_lm(build_lm(CONFIG))
    function = _summon.DTensorSummon.__enter__ if caller == "summon" else _stream.stream_full_params
    with patched():
        with _interrupt_after_return(_health.claim, function) as fired, pytest.raises(KeyboardInterrupt):
            if caller == "summon":
                with FSDP.summon_full_params(model, writeback=False):
                    raise AssertionError("the body ran")
            else:
                for _ in fsdp_shim.iter_full_params(model):
                    pass
        assert fired[0]

        def summon() -> None:
            with FSDP.summon_full_params(model, writeback=False):
                pass

        return _in_another_thread(summon)


@pytest.mark.parametrize("caller", ["summon", "stream"])
def test_d4_an_interrupt_right_after_a_claim_leaks_no_claim(dist_run, caller):
    assert dist_run(2, rank_d4_an_interrupt_right_after_a_claim_leaks_no_claim, caller) == ["ran", "ran"]


def rank_d5_an_interrupted_nested_exit_releases_once() -> dict[str, int]:
    """D5: a nested exit interrupted right after it forgot its claims released them twice; the outer context's
    next nested summon of its own unit then posted an all-gather (the README says it runs none)."""
    model = shard_lm(build_lm(CONFIG))
    with patched(), FSDP.summon_full_params(model, recurse=False, writeback=False):  # the root unit's own
        inner = FSDP.summon_full_params(model.blocks[0], recurse=False, writeback=False)  # nested, live
        with _interrupt_after_return(_registry.forget, _summon.DTensorSummon._release) as fired:
            with pytest.raises(KeyboardInterrupt):
                with inner:
                    pass
        assert fired[0]
        with counting_collectives() as counts, FSDP.summon_full_params(model, recurse=False, writeback=False):
            assert not isinstance(model.norm.weight, DTensor)  # served by the outer context
    return counts


def test_d5_an_interrupted_nested_exit_releases_once(dist_run):
    assert dist_run(2, rank_d5_an_interrupted_nested_exit_releases_once) == [{}, {}]


def rank_d6_an_interrupt_right_after_the_engine_turns_grad_off_leaves_grad_mode() -> bool:
    """D6: the stream left grad mode off after an interrupt right after the engine's switch (outside its
    ``try``); the caller's next ``backward()`` failed."""
    model = shard_lm(build_lm(CONFIG))
    with patched(), pytest.raises(KeyboardInterrupt):
        with _interrupt_at_line(engine.BucketGather.__init__, nth=1, when=lambda: not torch.is_grad_enabled()) as fired:
            for _ in fsdp_shim.iter_full_params(model):
                pass
    assert fired[0]
    return torch.is_grad_enabled()


def test_d6_an_interrupt_right_after_the_engine_turns_grad_off_leaves_grad_mode(dist_run):
    assert dist_run(2, rank_d6_an_interrupt_right_after_the_engine_turns_grad_off_leaves_grad_mode) == [True, True]


def rank_d8_the_completion_fence_runs_no_python_callback() -> list[str]:
    """D8: a Ctrl-C landing in the fence's ``Future.then`` callback reached the caller as ``RuntimeError: Got the
    following error when running the callback: KeyboardInterrupt``. No Python frame runs there now."""
    ran: list[str] = []
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()

    def record(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(engine.__file__.rsplit("/", 1)[0]):
            ran.append(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        fence = engine.completion([work], torch.device("cpu"))
        fence()
    finally:
        sys.setprofile(None)
    return [name for name in ran if name != "completion" and not name.startswith("<")]


def test_d8_the_completion_fence_runs_no_python_callback(dist_run):
    assert dist_run(2, rank_d8_the_completion_fence_runs_no_python_callback) == [[], []]


@contextlib.contextmanager
def _interrupt_before_return(callee: Callable[..., Any], caller: Callable[..., Any]) -> Iterator[list[bool]]:
    """Raise ``KeyboardInterrupt`` in ``callee``'s frame at the line of its last ``return``, when ``caller`` called
    it: its work done, its result (a hook's handle) not yet handed back. Yields ``[fired]``."""
    import ast
    import inspect
    import textwrap

    lines, start = inspect.getsourcelines(callee)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    last = max(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Return)) + start - 1
    code, caller_code = callee.__code__, caller.__code__
    fired = [False]

    def in_callee(frame, event, arg):
        if event == "line" and frame.f_lineno == last and not fired[0]:
            fired[0] = True
            raise KeyboardInterrupt(f"before {callee.__qualname__} returned to {caller.__qualname__}")
        return in_callee

    sys.settrace(lambda frame, event, arg: in_callee if frame.f_code is code and frame.f_back is not None
                 and frame.f_back.f_code is caller_code else None)
    try:
        yield fired
    finally:
        sys.settrace(None)


#: Where a hook a summon installs is registered and its handle not yet kept: (the registering call, its caller,
#: how: ``before``, the interrupt in the registering call at its ``return``, or ``after`` it returned; the
#: summon's keywords; whether the model computes in bf16).
_HOOK_WINDOWS = {
    "rank0_only refusal's hook": ("register_module_forward_pre_hook", "ForwardRefusal.install", "before",
                                  {"rank0_only": True}, False),
    "rank0_only refusal made, not installed": ("summon_groups", "DTensorSummon._gather_and_install", "after",
                                               {"rank0_only": True}, False),
    "partial unit refusal's hook": ("register_module_forward_pre_hook", "ForwardRefusal.install", "before",
                                    {"unit": "fc1"}, False),
    "backward refusal hook": ("register_forward_hook", "SummonedGroup._hook_forwards", "before", {}, False),
    "param_dtype cast hook": ("register_forward_pre_hook", "SummonedGroup._hook_forwards", "before", {}, True),
}


def rank_d9_an_interrupt_while_a_hook_is_registered_leaves_it_inert(window: str) -> list[bool]:
    """D9: an interrupt after a summon's hook was registered and before its handle was kept left the hook live
    after the failed entry: every later forward of the model refused (``rank0_only``, a unit summoned in part),
    every backward refused, or every forward cast by a stale switch. Now each such hook is emptied at release: a
    lost one does nothing. Against a twin never summoned (same seed), FSDP2 trains on exactly alike."""
    import torch.nn as nn
    from torch.nn.modules import module as module_file

    from fsdp_shim import _group

    callee_name, caller_name, how, kwargs, mixed = _HOOK_WINDOWS[window]
    callee = getattr(nn.Module, callee_name, None) or getattr(module_file, callee_name, None) \
        or getattr(_group, callee_name)
    owner, method = caller_name.split(".")
    caller = getattr(getattr(_group, owner, None) or getattr(_summon, owner), method)
    interrupt = _interrupt_before_return if how == "before" else _interrupt_after_return
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else None
    model, twin = shard_lm(build_lm(CONFIG), mp_policy=policy), shard_lm(build_lm(CONFIG), mp_policy=policy)
    tokens = tokens_for(CONFIG)
    summoned = model.blocks[0].fc1 if kwargs.get("unit") == "fc1" else model
    with patched(), interrupt(callee, caller) as fired, pytest.raises(KeyboardInterrupt):
        with FSDP.summon_full_params(summoned, writeback=False, rank0_only=kwargs.get("rank0_only", False)):
            pass
    said = [fired[0]]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    for _ in range(2):
        losses = [m(tokens).float().pow(2).mean() for m in (model, twin)]
        said.append(torch.equal(losses[0], losses[1]))
        for loss, optimizer in zip(losses, optimizers, strict=True):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return said


@pytest.mark.parametrize("window", list(_HOOK_WINDOWS))
def test_d9_an_interrupt_while_a_hook_is_registered_leaves_it_inert(dist_run, window):
    assert dist_run(2, rank_d9_an_interrupt_while_a_hook_is_registered_leaves_it_inert, window) == [
        [True, True, True]] * 2
