"""The real Composer (mosaicml 0.32.1) on its own FSDP2, launched as a compose-rl user launches it.

    composer -n 2 -m fsdp_shim.run tests/composer_job.py OUT.json (fsdp2config | dict)

Runs where mosaicml is installed: the matrix's torch 2.7.0 row installs
compose-rl's pins (mosaicml 0.32.1, transformers 4.51.3). The job
(``tests/composer_job.py``) holds no fsdp_shim code: the launcher line patches.
It fits, generates through Composer's gated ``HuggingFaceModel.generate``
with a KV cache, syncs weights unit by unit, fits again, and compares
everything with an unsharded model trained beside it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    MOSAICML = importlib.metadata.version("mosaicml")
except importlib.metadata.PackageNotFoundError:
    MOSAICML = None
LAUNCHER = shutil.which("composer", path=str(Path(sys.executable).parent))

pytestmark = pytest.mark.skipif(MOSAICML is None or LAUNCHER is None,
                                reason="the real Composer (mosaicml) is installed on the matrix's 2.7.0 row only")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, how: str, env: dict[str, str], job: str = "composer_job.py") -> dict:
    out = tmp_path / f"{how}.json"
    command = [LAUNCHER, "-n", "2", "--master_port", str(_free_port()),
               "-m", "fsdp_shim.run", str(ROOT / "tests" / job), str(out), how]
    full_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", **env}
    full_env.pop("PYTHONPATH", None)
    proc = subprocess.run(command, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


CASES = {
    "fsdp2config": {},  # parallelism_config={"fsdp": FSDP2Config()}
    "dict": {"FSDP_VERSION": "2"},  # FSDP1's dict config, converted by FSDP2Config.from_compatible_attrs
}


@pytest.mark.parametrize("how", list(CASES))
def test_composer_fsdp2_trains_generates_and_syncs_like_the_unsharded_model(tmp_path, how):
    report = _launch(tmp_path, how, CASES[how])
    assert report["shim_imported"], "the launcher line did not patch"
    assert report["sharded"] == ["FSDPLlamaForCausalLM", "FSDPLlamaDecoderLayer", "FSDPLlamaDecoderLayer"]
    assert "param_dtype=torch.float32" in report["param_dtype"]  # Composer always sets one: FSDP2 casts inputs
    for phase in ("after_fit", "after_second_fit"):
        assert report[phase] == {"names": True, "unequal": []}, (phase, report[phase])
    assert report["generate_tokens_equal"] and report["generate_max_logit_diff"] == 0.0, report
    # what FSDP_VERSION=2 changes besides the sharding: the checkpoint default (FSDP1's dict said full)
    assert report["state_dict_type"] == "sharded"


def test_composer_generate_without_the_cast_instrumentation(tmp_path):
    """Shows what ``fsdp2_cast`` mends: Composer's FSDP2 generate with transformers 4.5x on torch 2.7."""
    import transformers  # noqa: PLC0415
    from torch.distributed.fsdp._fully_shard import _fsdp_state  # noqa: PLC0415
    from torch.utils import _pytree  # noqa: PLC0415

    report = _launch(tmp_path, "fsdp2config", {"FSDP_SHIM_DISABLE_FSDP2_CAST": "1"})
    assert report["after_fit"] == {"names": True, "unequal": []}  # training is not touched by the cast
    if "tree_map" in vars(_fsdp_state) and transformers.DynamicCache in _pytree.SUPPORTED_NODES:
        assert not report["generate_tokens_equal"] or report["generate_max_logit_diff"] > 0.0, report
    else:
        assert report["generate_tokens_equal"] and report["generate_max_logit_diff"] == 0.0, report


@pytest.mark.parametrize("how", ["plain", "checkpointed"])
def test_composer_mpt_generation_through_compose_rl_helpers(tmp_path, how):
    """compose-rl's MPT helpers on Composer's own FSDP2 (``tests/composer_mpt_job.py``): the flag is on in every
    block while generating and off after, as on FSDP1; tokens and logits equal the unsharded model's."""
    report = _launch(tmp_path, how, {}, job="composer_mpt_job.py")
    assert report["shim_imported"]
    assert "FSDPMPTBlock" in report["units"], report["units"]
    if how == "checkpointed":
        assert all(name.endswith("CheckpointWrapper") for name in report["blocks"]), report["blocks"]
    assert "error" not in report, report
    assert report["tokens_equal"] and report["logits_equal"], report
    assert report["flags_while_generating"] == report["reference_flags_while_generating"] == [[True] * 3] * 4
    assert report["flags_after"] == [False] * 3


def test_composer_mpt_generation_without_the_instrumentation(tmp_path):
    """The control: with ``compose_rl_mpt`` switched off, compose-rl's helpers fail on Composer's FSDP2 blocks."""
    report = _launch(tmp_path, "plain", {"FSDP_SHIM_DISABLE_COMPOSE_RL_MPT": "1"}, job="composer_mpt_job.py")
    assert "_fsdp_wrapped_module" in report.get("error", ""), report
    assert report["flags_after_error"] == [False] * 3
