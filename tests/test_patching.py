"""The patch lifecycle (wrapt) and dispatch, in this process; the ``fully_shard`` guard the patch installs,
on two gloo ranks."""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
import wrapt
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

import fsdp_shim
from _helpers import LMConfig, assert_unchanged, full_state, patch_state_restored, patched, snapshot, tokens_for
from _helpers import reference_and_sharded as _models
from fsdp_shim import _versions
from fsdp_shim._scope_rule import is_fsdp1_tree
from fsdp_shim._summon import summon

ORIGINAL = inspect.getattr_static(FSDP, "summon_full_params")
while isinstance(ORIGINAL, wrapt.FunctionWrapper):  # the import patched it
    ORIGINAL = ORIGINAL.__wrapped__
SIGNATURE = inspect.signature(ORIGINAL.__func__)


@pytest.fixture(autouse=True)
def _restore_patch_state():
    was = fsdp_shim.is_patched()
    yield
    (fsdp_shim.patch if was else fsdp_shim.unpatch)()


def test_import_patches_with_a_wrapt_wrapper_around_the_staticmethod():
    assert fsdp_shim.is_patched()
    current = inspect.getattr_static(FSDP, "summon_full_params")
    assert isinstance(current, wrapt.FunctionWrapper)
    assert current.__wrapped__ is ORIGINAL and isinstance(ORIGINAL, staticmethod)
    assert inspect.signature(FSDP.summon_full_params) == SIGNATURE


def test_patch_unpatch_round_trip_restores_the_exact_object():
    assert fsdp_shim.patch() is False  # already patched: no second wrapper
    wrapper = inspect.getattr_static(FSDP, "summon_full_params")
    assert wrapper.__wrapped__ is ORIGINAL
    assert fsdp_shim.unpatch() is True
    assert inspect.getattr_static(FSDP, "summon_full_params") is ORIGINAL
    assert not fsdp_shim.is_patched()
    assert fsdp_shim.unpatch() is False  # harmless
    assert fsdp_shim.patch() is True
    assert fsdp_shim.is_patched()
    assert inspect.getattr_static(FSDP, "summon_full_params").__wrapped__ is ORIGINAL


def test_the_instance_form_comes_and_goes_with_active_mode():
    """``patch()`` gives ``FSDPModule`` the instance form and ``unpatch()`` takes it away; refusing mode writes
    nothing into FSDP2's classes (its torch's FSDP2 internals may not import), so a unit has none there, as
    without the shim: ``unit.summon_full_params`` raises ``AttributeError``, never FSDP1's silent no-op."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_shim import _patching

    assert "summon_full_params" in vars(FSDPModule)
    fsdp_shim.unpatch()
    assert "summon_full_params" not in vars(FSDPModule)
    _patching.patch("a reason")
    try:
        assert "summon_full_params" not in vars(FSDPModule)
    finally:
        fsdp_shim.unpatch()  # the fixture patches again, in active mode


def test_unpatch_beneath_a_third_party_wrapper_keeps_theirs():
    calls = []

    def theirs(wrapped, instance, args, kwargs):
        calls.append(1)
        return wrapped(*args, **kwargs)

    handle = wrapt.wrap_function_wrapper(FSDP, "summon_full_params", theirs)
    try:
        assert fsdp_shim.is_patched()  # ours is still in the chain
        assert fsdp_shim.unpatch() is True
        assert inspect.getattr_static(FSDP, "summon_full_params") is handle
        with FSDP.summon_full_params(nn.Linear(2, 2)):
            pass
        assert calls == [1]
        assert fsdp_shim.patch() is True  # on top of theirs
    finally:
        fsdp_shim.unpatch()
        wrapt.unwrap_object(FSDP, "summon_full_params", handle)
    assert inspect.getattr_static(FSDP, "summon_full_params") is ORIGINAL


def test_instance_access_still_works_like_a_staticmethod():
    """Reached through an FSDP1 instance, the patched staticmethod binds no ``self``: the module argument
    is the one the caller passed (as a bound method, the instance would be routed and the module
    taken as ``recurse``)."""
    instance = FSDP.__new__(FSDP)  # attribute access only: no process group needed
    bound = instance.summon_full_params
    with bound(nn.Linear(2, 2), recurse=False):
        pass
    with pytest.raises(TypeError, match="expects an nn.Module, got object"):
        bound(object())


def test_routing_rejects_non_modules_and_gives_plain_modules_a_null_context():
    assert isinstance(summon(nn.Linear(2, 2), True), contextlib.nullcontext)
    assert not is_fsdp1_tree(nn.Linear(2, 2), recurse=True)
    with pytest.raises(TypeError, match="nn.Module"):
        summon(object(), True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module"):
        FSDP.summon_full_params(object())
    with pytest.raises(TypeError):  # FSDP1's signature is enforced
        FSDP.summon_full_params(nn.Linear(2, 2), bogus=True)


def _python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=True
    )
    return result.stdout.strip()


def _two_at_a_time(run, calls):
    """``run(*args, **env)`` for each ``(args, env)`` of ``calls``, two at a time: each is a fresh interpreter that
    imports torch (seconds apiece, mostly one core's work)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda call: run(*call[0], **call[1]), calls))


@pytest.mark.parametrize("first", ["fsdp_shim", "torch.distributed.fsdp"])
def test_import_order_does_not_matter_and_the_import_is_light(first):
    """Deferred activation (``fsdp_shim._activate``): the patch lands whichever is imported first."""
    code = (
        "import sys\n"
        f"import {first}\n"
        "print('torch' in sys.modules)\n"
        "import fsdp_shim, inspect, wrapt\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "print(isinstance(inspect.getattr_static(FSDP, 'summon_full_params'), wrapt.FunctionWrapper))\n"
    )
    assert _python(code).split() == [str(first != "fsdp_shim"), "True"]


def test_help_and_version_do_not_import_torch():
    code = (
        "import sys\n"
        "from fsdp_shim.tools.cli import main\n"
        "for argv in (['--help'], ['check', '--help'], ['bench', '--help'], ['--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr.strip() == "False"
    assert "usage: fsdp-shim" in result.stdout and "--reps" in result.stdout


def test_versions_are_data_and_the_guard_reads_them():
    assert _versions.parse_version("2.13.0+cpu") == (2, 13, 0)
    assert _versions.parse_version("2.6.0a0+git1") == (2, 6, 0)
    assert _versions.is_supported_torch("2.7.0") and _versions.is_supported_torch("2.15.0+cu132")
    assert not _versions.is_supported_torch("2.6.0") and not _versions.is_supported_torch("2.16.0")
    assert _versions.is_newer_than_supported("2.16.0") and not _versions.is_newer_than_supported("2.6.0")
    assert _versions.is_verified_torch("2.13.0+cpu") and not _versions.is_verified_torch("2.13.1")
    assert all(_versions.is_supported_torch(v) for v in _versions.VERIFIED_TORCH)
    assert fsdp_shim.unsupported_reason is None
    # setup.cfg declares the same lower bounds (not the upper one: see [Note: version policy])
    setup_cfg = open(os.path.join(os.path.dirname(__file__), "..", "setup.cfg")).read()
    assert f"torch>={_versions.MIN_TORCH}\n" in setup_cfg
    assert f"wrapt>={_versions.MIN_WRAPT}\n" in setup_cfg
    root = os.path.join(os.path.dirname(__file__), "..")
    readme = open(os.path.join(root, "README.md")).read()
    assert _versions.SUPPORTED_TORCH in readme
    versions = open(os.path.join(root, "docs", "versions.md")).read()
    assert all(f"| {v} " in versions for v in _versions.VERIFIED_TORCH)  # the table of verified runs


def test_fsdp_shim_disable_takes_the_usual_truthy_spellings_and_imports_without_patching():
    code = "import fsdp_shim; print(fsdp_shim.is_patched())"
    values = ["1", "TRUE", "yes", "On", "", "0"]
    patched = _two_at_a_time(_python, [((code,), {"FSDP_SHIM_DISABLE": value}) for value in values])
    assert dict(zip(values, patched, strict=True)) == {
        "1": "False", "TRUE": "False", "yes": "False", "On": "False", "": "True", "0": "True"}


# A summon of a real FSDP2 model (a world of one on gloo) under a faked torch: it gathers, or it
# raises; it never returns FSDP1's silent no-op. See [Note: version policy].
_SUMMON_UNDER_FAKED_TORCH = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
import torch
import torch.distributed as dist
import torch.nn as nn
torch.__version__ = {version!r}
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor
for name in {remove!r}:
    delattr(FSDPParamGroup, name)
{before}
import fsdp_shim
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = fully_shard(nn.Linear(4, 4))
outcome = []
try:
    with FSDP.summon_full_params(model, writeback=False):
        outcome.append("gathered" if not isinstance(model.weight, DTensor) else "no-op")
except fsdp_shim.UnsupportedTorchError as exc:  # a RuntimeError, typed
    outcome.append("refused")
    print(exc, file=sys.stderr)
with FSDP.summon_full_params(nn.Linear(2, 2)):  # a plain module: FSDP1's null context, never refused
    outcome.append("plain")
parent = nn.Sequential(fully_shard(nn.Linear(4, 4)))  # its only DTensors are a nested unit's
with FSDP.summon_full_params(parent, recurse=False):  # both modes route it alike: a null context
    outcome.append("parent")
wrapper = nn.Sequential(model)  # a plain parent of the FSDP2 root, after a forward left the root unsharded
model(torch.ones(1, 4))
try:
    with FSDP.summon_full_params(wrapper, writeback=False):
        outcome.append("wrapper" if type(model.weight) is nn.Parameter else "wrapper-no-op")
except fsdp_shim.UnsupportedTorchError:
    outcome.append("refused")
except AttributeError:  # allowed to run without an internal it needs (FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH)
    outcome.append("missing")
print(fsdp_shim.is_patched(), fsdp_shim.unsupported_reason is not None, *outcome)
"""


def _summon_under(version: str, remove: tuple[str, ...] = (), before: str = "", **env: str) -> tuple[str, str]:
    code = _SUMMON_UNDER_FAKED_TORCH.format(version=version, remove=remove, before=before)
    clean = {k: v for k, v in os.environ.items() if k != _versions.ALLOW_UNSUPPORTED_TORCH_ENV}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env},
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1], result.stderr  # torch 2.8-2.10: gloo's banner comes first


def test_a_newer_torch_with_every_internal_present_is_served_with_a_warning():
    out, err = _summon_under("2.16.0")
    assert out == "True False gathered plain parent wrapper"
    assert "torch 2.16.0 is newer than the verified" in err and "fsdp-shim check" in err


def test_a_newer_torch_missing_an_internal_refuses_dtensor_summons_by_name():
    (out, err), allowed = _two_at_a_time(_summon_under, [
        (("2.16.0", ("_to_sharded",)), {}),
        (("2.16.0", ("_to_sharded",)), {"FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH": "1"}),
    ])
    assert out == "True True refused plain parent refused"
    assert "torch 2.16.0 lacks FSDP2 internals fsdp_shim reads: FSDPParamGroup._to_sharded" in err
    assert "FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH=1" in err and "silently do nothing" in err
    # the override gathers anyway, and says so
    out, err = allowed
    assert out == "True False gathered plain parent missing" and "gathering although" in err  # at your own risk


def test_an_older_torch_refuses_dtensor_summons_unless_allowed():
    (out, err), other_rank, allowed = _two_at_a_time(_summon_under, [
        (("2.6.0",), {}),
        (("2.6.0",), {"RANK": "1"}),  # under torchrun: rank 0 speaks for the job
        (("2.6.0",), {"FSDP_SHIM_ALLOW_UNSUPPORTED_TORCH": "1"}),
    ])
    assert out == "True True refused plain parent refused"
    assert "torch 2.6.0 is outside the supported torch >= 2.7, < 2.16" in err
    assert other_rank[0] == "True True refused plain parent refused" and "refuses DTensor summons" not in other_rank[1]
    out, err = allowed
    assert out == "True False gathered plain parent wrapper" and "gathering although" in err


def test_internals_that_cannot_be_imported_refuse_dtensor_summons():
    hide = "import torch.distributed.fsdp\nsys.modules['torch.distributed.fsdp._fully_shard._fsdp_state'] = None"
    public = ("import sys, torch.distributed.fsdp\n"
              "sys.modules['torch.distributed.fsdp._fully_shard._fsdp_state'] = None\n"
              "import fsdp_shim\ntry:\n    fsdp_shim.summon_full_params(None)\n"
              "except RuntimeError as exc:\n    print('refuses' in str(exc))")
    (out, err), refused = _two_at_a_time(lambda run, *args: run(*args), [
        ((_summon_under, torch_version(), (), hide), {}), ((_python, public), {})])
    assert out == "True True refused plain parent refused"
    assert "lacks the FSDP2 internals fsdp_shim uses" in err
    assert refused == "True"  # the public API refuses too


def torch_version() -> str:
    import torch

    return torch.__version__


def test_the_wrapper_binds_arguments_with_fsdp1s_exact_signature():
    """The wrapper binds FSDP1's arguments with a plain function; its signature must be FSDP1's, defaults too."""
    from fsdp_shim import _patching

    def shape(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert shape(_patching._fsdp1_arguments) == shape(ORIGINAL.__func__)  # refusing mode's
    with pytest.raises(TypeError):
        _patching._fsdp1_arguments(nn.Linear(1, 1), True, True, False, False, False, "one too many")
    from fsdp_shim import _summon

    positional = [p for p in shape(_summon.summon) if p[1] is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == shape(ORIGINAL.__func__)  # the active mode's: ``summon`` binds them


#: Calls FSDP1's signature does not take: FSDP1 refuses each with a ``TypeError``.
_BAD_CALLS = [((), {}), ((), {"recurse": False}), (("m",), {"module": "m"}), (("m", True), {"recurse": False}),
              (("m", True, True, False, False, False, "one too many"), {}), (("m",), {"bucket_mb": 4}),
              (("m",), {"fsdp1": None}), (("m",), {"nonsense": 1})]


@pytest.mark.parametrize("mode", ["active", "refusing"])
def test_arguments_fsdp1_does_not_take_are_refused_in_fsdp1s_words(mode):
    """Each mode's wrapper refuses what FSDP1 refuses, with FSDP1's own ``TypeError`` message (not one
    naming the shim's binding function)."""
    from fsdp_shim import _patching

    def said(args, kwargs):
        args = tuple(nn.Linear(1, 1) if a == "m" else a for a in args)
        kwargs = {k: nn.Linear(1, 1) if v == "m" else v for k, v in kwargs.items()}
        with pytest.raises(TypeError) as raised:
            FSDP.summon_full_params(*args, **kwargs)
        return str(raised.value)

    fsdp_shim.unpatch()
    fsdp1 = [said(*call) for call in _BAD_CALLS]
    if mode == "active":
        fsdp_shim.patch()
    else:
        _patching.patch("a reason")
    try:
        assert [said(*call) for call in _BAD_CALLS] == fsdp1
    finally:
        fsdp_shim.unpatch()  # the fixture patches again, in active mode: refusing mode never outlives this test
    assert all(m.startswith("FullyShardedDataParallel.summon_full_params()") for m in fsdp1), fsdp1


def rank_fully_shard_inside_is_refused():
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=True):
        with pytest.raises(RuntimeError, match=r"fully_shard\(\) inside summon_full_params"):
            fully_shard(model.embed)
        assert not hasattr(model.embed, "_get_fsdp_state")  # untouched: no state, no class swap
    assert_unchanged(model, before)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(2):
        for m, optimizer in zip((model, ref), optimizers):
            m(tokens).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    got = full_state(model)
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    fully_shard(nn.Linear(2, 2))  # outside, fully_shard works
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState  # noqa: PLC0415

    with patch_state_restored():  # the guard is part of the patch: in with patch(), out with unpatch()
        fsdp_shim.unpatch()
        assert not hasattr(FSDPState.__init__, "__wrapped__")
        fsdp_shim.patch()
        assert hasattr(FSDPState.__init__, "__wrapped__")


def test_fully_shard_inside_the_context_is_refused(dist_run):
    dist_run(2, rank_fully_shard_inside_is_refused)
