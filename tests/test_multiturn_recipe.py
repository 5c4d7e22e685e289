"""Multi-turn GRPO through `tune run`: a scripted tool-calling engine, the calculator environment, the
model directory's chat template listing the tools; episode metrics and whole episodes in the logs.

The scripted engine (tests._engines.ToolScriptGenerator) makes every episode's text a function of its
prompt and row, so one-process, two-process and resumed runs see the same episodes:

- one process (configs/tiny/multi_turn_cpu.yaml with a tool template and the scripted engine): 4 steps,
  checkpoints at steps 2 and 4 (the reference of the others);
- two processes with half the batch each: the same per-step metrics (same global batch, same episodes);
- killed right after the step-3 rollouts (mid multi-turn run) and resumed: the same weights and metrics as
  the uninterrupted run;
- the LoRA recipe: a short run with the same episodes.

The one-process reference, the resume after the kill and the LoRA run are in process. The vLLM engine with multi-turn episodes (a real
model's continuation turns): tests/test_vllm_recipe.py::
test_two_processes_one_engine_per_rank_running_multi_turn_episodes.
"""

import logging
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.chat_templates import make_tokenizer_dir
from tests.conftest import REPO
from tests.recipe_utils import read_jsonl, run_in_process, run_tune, with_overrides, write_config
from tests.test_distributed_runs import STEPS, assert_same_run, run_killed
from tests.test_lora_recipe import LORA_CONFIG

MULTI_TURN_CONFIG = REPO / "configs" / "tiny" / "multi_turn_cpu.yaml"
# Saves at steps 2 and 4 (STEPS); keep_last_n_checkpoints=1 leaves only step_4 at the end.
SCHEDULE = dict(max_steps=STEPS, save_every_n_steps=2, keep_last_n_checkpoints=1)


def multi_turn_config(tmp_path: Path, base: Path = MULTI_TURN_CONFIG, **overrides) -> Path:
    """configs/tiny/multi_turn_cpu.yaml (or ``base`` with its environment and multi_turn sections) with a
    Hermes tool template, which lists the calculator in the system message, and the scripted engine."""
    tok_dir = make_tokenizer_dir(tmp_path / "tok", "qwen2_5_tools")
    if base != MULTI_TURN_CONFIG:
        shipped = OmegaConf.to_container(OmegaConf.load(MULTI_TURN_CONFIG))
        overrides = {"environment": shipped["environment"], "multi_turn": shipped["multi_turn"], **overrides}
    return write_config(
        tmp_path,
        base=base,
        tokenizer={"_component_": "torchtune_grpo.models.hf_tokenizer", "path": str(tok_dir)},
        **{"dataset.prompt_style": "chat", "dataset.system_prompt": "Use the calculator."},
        generation={"_component_": "tests._engines.ToolScriptGenerator", "tokenizer_dir": str(tok_dir)},
        max_response_length=200,
        max_prompt_length=700,  # the system message lists the tools (~560 byte-level tokens)
        **overrides,
    )


def assert_scripted_episodes(rows) -> None:
    """The episode metrics the scripted engine fixes, whatever the prompts."""
    for r in rows:
        # half the episodes call the calculator once (2 turns), half answer at once (1 turn)
        assert r["episode/turns"] == 1.5 and r["episode/tool_calls"] == 0.5, r
        assert r["episode/tool_errors"] == 0 and r["episode/env_error"] == 0, r
        assert r["truncated_fraction"] == 0, r  # every episode ended with its answer
        assert r["episode/injected_tokens"] > 0 and "time/environment" in r
        assert r["episode/generated_tokens"] + r["episode/injected_tokens"] == r["response_length/mean"]
        assert torch.isfinite(torch.tensor(r["loss"]))


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """A 4-step multi-turn run on one process: (output directory, its log)."""
    tmp = tmp_path_factory.mktemp("multi_turn_1proc")
    # In process: the recipe's setup/train/cleanup without the launcher (the runs compared with it below
    # go through `tune run`).
    log: list = []
    run_in_process(multi_turn_config(tmp, **SCHEDULE), log=log)
    return tmp / "out", "\n".join(log)


def test_tool_episodes_train_and_log(one_process_run):
    out, output = one_process_run
    assert "Multi-turn episodes: ToolEnvironment, at most 3 turns, replies rendered by ChatTurns" in output
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_scripted_episodes(rows)
    record = next(c for c in read_jsonl(out / "completions.jsonl") if len(c["conversation"]) > 1)
    assert [m["role"] for m in record["conversation"]] == ["assistant", "tool", "assistant"]
    assert record["conversation"][1]["content"] == "42"
    assert record["conversation"][2]["content"] == "The answer is 42."
    assert "# Tools" in record["prompt"] and '"name": "calculator"' in record["prompt"]
    card = (out / "algorithm_card.md").read_text()
    assert "- Multi-turn episodes (ToolEnvironment, at most 3 turns): o_i is a whole episode" in card


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, one_process_run):
    # batch_size is per rank: 2 x 2 ranks is the one-process run's global batch of 4 prompts, and the
    # sampler deals the same shuffled prompts out to the ranks. The engine ignores the weights, so both runs
    # see the same episodes; losses and rewards are normalised over the global batch (process invariant).
    out, _ = one_process_run
    cfg = multi_turn_config(tmp_path, **SCHEDULE, batch_size=2)
    log = run_tune(cfg, nproc=2, cwd=tmp_path)
    assert "2 rank(s)" in log
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    reference = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_scripted_episodes(rows)
    # Episode counts, rewards and lengths are exact (the same scripted episodes). loss, policy_loss, kl and grad_norm
    # are fp32 sums over the step's tokens (grad_norm: of squared gradients over every weight) grouped by rank, then
    # all-reduced: regrouped sums differ by ~sqrt(n) ulp of their magnitude (tests/tolerances.py), ~1e-6 relative; later
    # steps start from weights one AdamW step apart by about lr x that (AdamW's m / sqrt(v) is insensitive to a
    # gradient's relative rounding), moving these metrics by far less. Bound: 1e-4 relative, 1e-6 absolute for values
    # near 0.
    for got, want in zip(rows, reference):
        for key in ("episode/turns", "episode/tool_calls", "episode/injected_tokens", "episode/generated_tokens",
                    "reward/mean", "reward/std", "response_length/mean", "loss", "policy_loss", "kl", "grad_norm"):
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-6), (got["step"], key, got[key], want[key])


@pytest.mark.slow
def test_killed_mid_multi_turn_run_resumes_exactly(tmp_path, one_process_run, clean_env, one_thread):
    # Killed right after the step-3 episodes were run and scored (nothing trained): step_2 is the checkpoint.
    # The kill is a real launch (SIGKILL ends the process); the resume is judged by its numbers: in process.
    out, _ = one_process_run
    cfg = multi_turn_config(tmp_path, **SCHEDULE)
    run_killed(cfg, "rollout:3", nproc=1, cwd=tmp_path)
    assert [m["step"] for m in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [1, 2]
    log: list = []
    run_in_process(with_overrides(cfg, resume_from_checkpoint=True), log=log)
    assert f"Resuming from {tmp_path / 'out' / 'step_2'}" in "\n".join(log)
    assert_same_run(tmp_path / "out", out)  # weights, every metric but timings (episode/* included)


def test_lora_recipe_runs_tool_episodes(tmp_path, clean_env, one_thread, caplog):
    # In process (the LoRA recipe through `tune run`: tests/test_lora_recipe.py).
    cfg = multi_turn_config(tmp_path, base=LORA_CONFIG, max_steps=2, save_every_n_steps=2)
    with caplog.at_level(logging.INFO):
        run_in_process(cfg, lora=True)
    assert "Multi-turn episodes: ToolEnvironment, at most 3 turns, replies rendered by ChatTurns" in caplog.text
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert_scripted_episodes(rows)
    assert any(r["grad_norm"] > 0 for r in rows)
    # The adapter trained on the model's turns: every B started at zero.
    adapter = torch.load(tmp_path / "out" / "step_2" / "adapter_model.pt", weights_only=True)
    lora_b = [v for k, v in adapter.items() if k.endswith("lora_b.weight")]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)
