"""Every code block in README.md runs as written (Python on 2 gloo ranks) or is marked for what it is.

Declared scaffolding, the only names a Python block may use without defining
them: ``model`` (a tied-embedding LM sharded with ``fully_shard``, with
``generate(tokens, steps)``), ``prompt`` (token ids) and ``send(name, tensor)``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from _helpers import LMConfig, build_lm, full_state, patched, shard_lm, tokens_for

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"(?:<!-- (?P<marker>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
MARKERS = {"test-command", "main-command", "illustrative"}


def _blocks() -> list[tuple[str | None, str, str]]:
    return [(m["marker"], m["lang"], m["body"]) for m in FENCE.finditer(README.read_text())]


def rank_run_readme_block(code: str) -> list[str]:
    model = shard_lm(build_lm())
    sent: dict[str, torch.Tensor] = {}

    def send(name: str, tensor: torch.Tensor) -> None:
        assert name not in sent, f"{name} sent twice"
        sent[name] = tensor.detach().clone()

    namespace = {"model": model, "prompt": tokens_for(LMConfig()), "send": send, "__name__": "__readme__"}
    logger, root = logging.getLogger("fsdp_shim"), logging.getLogger()
    level, handlers = logger.level, list(root.handlers)
    try:
        with patched():
            exec(compile(code, str(README), "exec"), namespace)  # noqa: S102  (our own README)
    finally:  # the ranks are shared with later tests: leave logging as found
        logger.setLevel(level)
        root.handlers[:] = handlers
    if "banned" in namespace:  # the writeback example: rows silenced in every shard and in the tie
        state = full_state(model)
        banned = namespace["banned"]
        assert model.lm_head.weight is model.embed.weight  # one tied parameter, named embed.weight
        assert torch.all(state["embed.weight"][banned] == 0)
        assert torch.equal(state["embed.weight"][1], build_lm().embed.weight[1])
    return sorted(sent)


def test_every_python_block_in_the_readme_runs(dist_run):
    python_blocks = [body for _, lang, body in _blocks() if lang == "python"]
    assert len(python_blocks) >= 2
    for code in python_blocks:
        sent = dist_run(2, rank_run_readme_block, code)
        if "send(" in code:  # rank 0 sent every parameter once, under its own name
            assert sent[0] == sorted(n for n, _ in build_lm().named_parameters()) and sent[1] == []


def test_every_shell_block_is_run_or_marked():
    shell = [(marker, body) for marker, lang, body in _blocks() if lang in ("bash", "sh", "shell")]
    assert shell
    for marker, body in shell:
        assert marker in MARKERS, f"unmarked shell block in README.md:\n{body}"
    assert sum(marker == "test-command" for marker, _ in shell) == 1  # what .ci/run executes
    assert sum(marker == "main-command" for marker, _ in shell) == 1
