"""Multi-turn GRPO through `tune run`: a scripted tool-calling engine, the calculator environment, the
model directory's chat template listing the tools; episode metrics and whole episodes in the logs."""

from pathlib import Path

import torch

from tests.chat_templates import make_tokenizer_dir
from tests.recipe_utils import read_jsonl, run_tune, write_config


def test_tool_episodes_train_and_log(tmp_path: Path):
    tok_dir = make_tokenizer_dir(tmp_path / "tok", "qwen2_5_tools")
    config = write_config(
        tmp_path,
        max_steps=2,
        tokenizer={"_component_": "torchtune_grpo.models.hf_tokenizer", "path": str(tok_dir)},
        **{"dataset.prompt_style": "chat"},
        generation={"_component_": "tests._engines.ToolScriptGenerator", "tokenizer_dir": str(tok_dir)},
        environment={
            "_component_": "torchtune_grpo.multiturn.ToolEnvironment",
            "tools": ["torchtune_grpo.multiturn.Calculator"],
        },
        multi_turn={"max_turns": 3, "env_timeout": 10},
        max_response_length=200,
        max_prompt_length=700,  # the system message lists the tools (~560 byte-level tokens)
    )
    output = run_tune(config, cwd=tmp_path)
    assert "Multi-turn episodes: ToolEnvironment, at most 3 turns, replies rendered by ChatTurns" in output
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # half the episodes call the calculator once (2 turns), half answer at once (1 turn)
        assert r["episode/turns"] == 1.5 and r["episode/tool_calls"] == 0.5, r
        assert r["episode/tool_errors"] == 0 and r["episode/env_error"] == 0, r
        assert r["truncated_fraction"] == 0, r  # every episode ended with its answer
        assert r["episode/injected_tokens"] > 0 and "time/environment" in r
        assert r["episode/generated_tokens"] + r["episode/injected_tokens"] == r["response_length/mean"]
        assert torch.isfinite(torch.tensor(r["loss"]))
    record = next(c for c in read_jsonl(tmp_path / "out" / "completions.jsonl") if len(c["conversation"]) > 1)
    assert [m["role"] for m in record["conversation"]] == ["assistant", "tool", "assistant"]
    assert record["conversation"][1]["content"] == "42"
    assert record["conversation"][2]["content"] == "The answer is 42."
    assert "# Tools" in record["prompt"] and '"name": "calculator"' in record["prompt"]
