"""compose-rl's MPT generation on the real Composer's FSDP2, with no fsdp_shim code in it.

    composer -n 2 -m fsdp_shim.run tests/composer_mpt_job.py OUT.json (plain | checkpointed)

Real Composer (mosaicml 0.32.1) shards an llm-foundry-style MPT model
(``test_mpt_generate.MPTLike``: its blocks are marked ``_fsdp_wrap``, and
``_activation_checkpointing`` for ``checkpointed``) with its own FSDP2 on
gloo, as llm-foundry marks MPT's blocks. Generation then runs through the
stand-in of compose-rl's ``hf_generate`` and its two MPT helpers
(``tests/stand_ins/compose_rl``), which reach each block through
``_fsdp_wrapped_module``. Rank 0 writes to ``OUT.json`` the tokens' and
logits' equality with the unsharded model generating through the same
helpers, the flags every block saw while generating and after, and, with
``FSDP_SHIM_DISABLE_COMPOSE_RL_MPT=1`` (the control), the error instead.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from composer import Trainer
from composer.models import ComposerModel
from composer.utils import FSDP2Config
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "stand_ins"))
from test_mpt_generate import GENERATION, MPTLike, _generate_recording  # noqa: E402


class ComposerMPT(ComposerModel):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.model = MPTLike()
        for block in self.model.transformer.blocks:
            block._fsdp_wrap = True  # llm-foundry's marks, read by Composer's FSDP2 policy and its AC
            block._activation_checkpointing = checkpointed

    def forward(self, batch):  # type: ignore[override]
        return self.model(batch["input_ids"])

    def loss(self, outputs, batch):  # type: ignore[override]
        return outputs.float().pow(2).mean()


def main(out: str, how: str) -> None:
    checkpointed = how == "checkpointed"
    composer_model = ComposerMPT(checkpointed)
    trainer = Trainer(model=composer_model, parallelism_config={"fsdp": FSDP2Config(activation_checkpointing=checkpointed)},
                      device="cpu", progress_bar=False, log_to_console=False, loggers=[], save_folder=None)
    __import__(GENERATION)
    mpt = composer_model.model
    report: dict[str, object] = {
        "shim_imported": "fsdp_shim" in sys.modules,
        "units": [type(m).__name__ for m in composer_model.modules() if isinstance(m, FSDPModule)],
        "blocks": [type(b).__name__ for b in mpt.transformer.blocks],
    }
    control = os.environ.get("FSDP_SHIM_DISABLE_COMPOSE_RL_MPT") == "1"
    want = None if control else _generate_recording(MPTLike())  # the helpers fail on unwrapped blocks too, off
    try:
        got = _generate_recording(mpt)
    except AttributeError as error:
        report["error"] = f"AttributeError: {error}"
        report["flags_after_error"] = [m.use_pad_tok_in_ffn for m in mpt.modules() if hasattr(m, "use_pad_tok_in_ffn")]
    else:
        assert want is not None, "the control generated"
        report["tokens_equal"] = torch.equal(got[0], want[0])
        report["logits_equal"] = torch.equal(got[3], want[3])
        report["flags_while_generating"] = got[1]
        report["flags_after"] = got[2]
        report["reference_flags_while_generating"] = want[1]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
