"""A compose-rl-shaped Composer job on FSDP2, with no fsdp_shim code in it; ``test_composer_real.py`` launches it.

    composer -n 2 -m fsdp_shim.run tests/composer_job.py OUT.json (fsdp2config | dict)

Real Composer (mosaicml 0.32.1) shards a tiny Hugging Face Llama with its own
FSDP2: ``FSDP2Config`` (``fsdp2config``), or FSDP1's plain dict with
``FSDP_VERSION=2`` (``dict``, the switch a compose-rl user flips). On gloo it
fits a few batches, then does what compose-rl's RL loop does between steps:

1. generation through Composer's own ``HuggingFaceModel.generate``, gated on
   ``is_model_fsdp``, greedy with a KV cache;
2. a per-unit weight sync as compose-rl writes it: FSDP1's
   ``summon_full_params(unit, writeback=False, rank0_only=True, recurse=False)``
   on every unit, rank 0 reading each full parameter;
3. training again, and the sync again.

Every rank sees the same batches, and an unsharded copy of the model trains
beside it in plain PyTorch. torch 2.7's gloo sums FSDP2 gradients where it
should average (x2 on 2 ranks); Adam with a negligible eps is invariant to
that scale, exactly, so parameters are compared with ``torch.equal``. Rank 0
writes what it found to ``OUT.json``; the test judges it.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import transformers
from composer import Trainer
from composer.models import HuggingFaceModel
from composer.utils import FSDP2Config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader, DistributedSampler

VOCAB, STEPS, BATCHES = 101, 6, 5


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def samples() -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (2 * BATCHES, 12), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, eps=1e-30)  # scale-invariant: see the module docstring


def synced(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """compose-rl's per-unit weight sync, FSDP1's call on every FSDP2 unit; rank 0 keeps what it reads."""
    sent: dict[str, torch.Tensor] = {}
    for prefix, unit in model.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        with FSDP.summon_full_params(unit, writeback=False, rank0_only=True, recurse=False):
            if dist.get_rank() == 0:
                for name, param in unit.named_parameters():
                    if type(param) is torch.nn.Parameter:  # this unit's own, now full; nested units stay sharded
                        sent.setdefault(f"{prefix}.{name}" if prefix else name, param.detach().clone())
    return sent


def compare(sent: dict[str, torch.Tensor], reference: torch.nn.Module) -> dict[str, object]:
    want = dict(reference.named_parameters())
    return {
        "names": sorted(sent) == sorted(want),
        "unequal": sorted(n for n in want if n in sent and not torch.equal(sent[n], want[n].detach())),
    }


def main(out: str, how: str) -> None:
    parallelism = {"fsdp": FSDP2Config() if how == "fsdp2config" else {"sharding_strategy": "FULL_SHARD"}}
    data = samples()
    # the same batches on every rank, in order (Composer insists on a DistributedSampler)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=False))
    batches = list(loader)
    composer_model = HuggingFaceModel(llama(), tokenizer=None, use_logits=True)
    # llm-foundry's rule: every decoder layer its own unit, the HF model the root
    composer_model.model.fsdp_wrap_fn = lambda m: isinstance(m, transformers.models.llama.modeling_llama.LlamaDecoderLayer)
    trainer = Trainer(model=composer_model, train_dataloader=loader, optimizers=adam(composer_model.parameters()),
                      max_duration="3ba", device_train_microbatch_size=2, parallelism_config=parallelism, device="cpu", progress_bar=False,
                      log_to_console=False, loggers=[], save_folder=None)
    reference = llama()
    reference_optimizer = adam(reference.parameters())

    def train_reference(steps: range) -> None:
        reference.train()
        for i in steps:
            reference(**batches[i]).loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()

    report: dict[str, object] = {"shim_imported": "fsdp_shim" in sys.modules}
    hf = composer_model.model
    report["sharded"] = [type(m).__name__ for m in hf.modules() if isinstance(m, FSDPModule)]
    report["param_dtype"] = str(getattr(getattr(hf, "_get_fsdp_state", lambda: None)(), "_mp_policy", None))
    report["state_dict_type"] = getattr(trainer.state.fsdp_config, "state_dict_type", None)
    trainer.fit()
    train_reference(range(3))
    report["after_fit"] = compare(synced(hf), reference)

    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    kwargs = {"max_new_tokens": STEPS, "do_sample": False, "use_cache": True, "pad_token_id": 0,
              "output_scores": True, "return_dict_in_generate": True}
    hf.eval()
    reference.eval()
    got = composer_model.generate(prompt, **kwargs)
    want = reference.generate(prompt, **kwargs)
    report["generate_tokens_equal"] = torch.equal(got.sequences, want.sequences)
    report["generate_max_logit_diff"] = max((a - b).abs().max().item() for a, b in zip(got.scores, want.scores))

    trainer.fit(duration="2ba")
    train_reference(range(3, 5))
    report["after_second_fit"] = compare(synced(hf), reference)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
