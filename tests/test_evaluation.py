"""Held-out evaluation, plots, rejection sampling and their ``tune-grpo`` commands (fast: scripted engine)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import REPO
from torchtune_grpo.assets import asset_path
from torchtune_grpo.cli import main as cli_main
from torchtune_grpo.data import arithmetic_dataset, sft_dataset
from torchtune_grpo.rollouts.evaluation import correctness_name, evaluate, EvalSums, pass_at_k
from torchtune_grpo.generation import Rollout
from torchtune_grpo.metrics.plotting import plot_run, read_metrics
from torchtune_grpo.rollouts.rejection_sampling import rejection_sample, write_jsonl
from torchtune_grpo.rewards import build_reward_set

TUNE_GRPO = str(Path(sys.executable).parent / "tune-grpo")


@pytest.fixture
def rewards():
    return build_reward_set(
        [
            {"_component_": "torchtune_grpo.rewards.FormatReward", "name": "format", "weight": 0.5},
            {"_component_": "torchtune_grpo.rewards.MathAnswerReward", "name": "correctness", "weight": 1.0},
        ]
    )


class AnswerEngine:
    """Scripted engine: for prompt ``i`` of a call, sample ``j`` answers right when ``j < right[i]``.

    Greedy (temperature 0) answers right when ``greedy[i]``. Completions are real text in the R1 format.
    """

    temperature = 1.0

    def __init__(self, tokenizer, answers: List[str], greedy: List[bool], right: List[int]):
        self.tok, self.answers, self.greedy, self.right = tokenizer, answers, greedy, right
        self.offset = 0  # prompts already seen (evaluate calls us batch by batch)
        self.calls = []

    def generate(self, model, prompts, *, group_size, max_new_tokens, pad_id, stop_tokens, generator=None,
                 temperature: Optional[float] = None) -> Rollout:
        self.calls.append((len(prompts), group_size, temperature))
        responses = []
        for i in range(len(prompts)):
            k = self.offset + i
            for j in range(group_size):
                ok = self.greedy[k] if temperature == 0 else j < self.right[k]
                value = self.answers[k] if ok else str(int(self.answers[k]) + 1)
                text = f" x </think> <answer> {value} </answer>"
                responses.append(self.tok.encode(text, add_bos=False, add_eos=False) + [self.tok.eos_id])
        if temperature != 0:
            self.offset += len(prompts)  # the sampled pass comes after the greedy one for each batch
        return Rollout([list(p) for p in prompts for _ in range(group_size)], responses,
                       torch.zeros(len(responses), dtype=torch.bool))


def _prompts(tokenizer, n=4):
    ds = arithmetic_dataset(tokenizer, num_samples=n, max_value=20, split="validation")
    return [ds[i] for i in range(n)]


# --------------------------------------------------------------------------------------- pass@k


def test_pass_at_k_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    # float64 ratios of exact binomials: one or two roundings (1e-16 relative); approx's default 1e-6 relative.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # k = n: "any of the n correct"
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    # k = 1: the fraction correct, c/n
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_correctness_name_errors_clearly():
    assert correctness_name(["format", "correctness"]) == "correctness"
    assert correctness_name(["format", "exact"], "exact") == "exact"
    with pytest.raises(ValueError, match="named 'correctness'.*eval_reward"):
        correctness_name(["format"])


# ------------------------------------------------------------------------------------- evaluate


def test_evaluate_greedy_accuracy_reward_and_pass_at_k(tokenizer, rewards):
    prompts = _prompts(tokenizer)
    answers = [p["answer"] for p in prompts]
    engine = AnswerEngine(tokenizer, answers, greedy=[True, False, True, False], right=[4, 2, 0, 1])
    model = torch.nn.Linear(1, 1)
    records = []
    sums = evaluate(model, tokenizer, engine, prompts, rewards, max_new_tokens=16, num_samples=4, k=2,
                    batch_size=3, records=records)
    m = sums.metrics()
    # Counts and rewards (multiples of 0.5, exact in fp32) summed and divided in float64, and pass@2 terms as
    # above: a few roundings at 1e-16 relative; approx's default 1e-6 relative here and below.
    assert m["eval/accuracy"] == pytest.approx(0.5)
    # greedy rewards: right ones 0.5 (format) + 1 (correct), wrong ones 0.5
    assert m["eval/reward/mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 0.5) / 4)
    # pass@2 with n=4: c=4 -> 1, c=2 -> 1 - C(2,2)/C(4,2) = 5/6, c=0 -> 0, c=1 -> 0.5
    assert m["eval/pass@2"] == pytest.approx((1 + 5 / 6 + 0 + 0.5) / 4)
    assert m["eval/num_prompts"] == 4
    # greedy calls are temperature 0, one completion per prompt; sampled calls use the engine's temperature
    assert (3, 1, 0.0) in engine.calls and (3, 4, None) in engine.calls
    assert [r["correct"] for r in records] == [True, False, True, False]


def test_eval_sums_add_across_ranks(tokenizer, rewards):
    # What the recipe does with 2 ranks: sums of each shard, all-reduced, equal the sums of the whole.
    prompts = _prompts(tokenizer)
    answers = [p["answer"] for p in prompts]
    kw = dict(max_new_tokens=16, num_samples=2)
    whole = evaluate(torch.nn.Linear(1, 1), tokenizer,
                     AnswerEngine(tokenizer, answers, [True, False, True, True], [2, 1, 0, 2]), prompts, rewards, **kw)
    a = evaluate(torch.nn.Linear(1, 1), tokenizer,
                 AnswerEngine(tokenizer, answers[:2], [True, False], [2, 1]), prompts[:2], rewards, **kw)
    b = evaluate(torch.nn.Linear(1, 1), tokenizer,
                 AnswerEngine(tokenizer, answers[2:], [True, True], [0, 2]), prompts[2:], rewards, **kw)
    merged = EvalSums.from_list([x + y for x, y in zip(a.as_list(), b.as_list())], k=a.k)
    # The same exact sums (counts, multiples of 0.5, float64 pass@k terms) in another grouping: float64 roundings
    # only. Bound: approx's default 1e-6 relative.
    assert merged.metrics() == pytest.approx(whole.metrics())


def test_evaluate_without_correctness_component_fails(tokenizer):
    only_format = build_reward_set([{"_component_": "torchtune_grpo.rewards.FormatReward"}])
    with pytest.raises(ValueError, match="correctness"):
        evaluate(torch.nn.Linear(1, 1), tokenizer, None, _prompts(tokenizer), only_format, max_new_tokens=4)


# ------------------------------------------------------------------------------------------ plot


def _metrics_file(tmp_path: Path) -> Path:
    rows = [{"step": 0, "eval/accuracy": 0.2, "eval/pass@4": 0.5, "eval/reward/mean": 0.3}]
    for s in range(1, 6):
        rows.append({"step": s, "reward/mean": 0.1 * s, "kl": 0.01 * s, "response_length/mean": 20 - s})
    rows.append({"step": 5, "eval/accuracy": 0.6, "eval/pass@4": 0.8, "eval/reward/mean": 0.7})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    return tmp_path / "metrics.jsonl"


def test_plot_writes_png(tmp_path):
    _metrics_file(tmp_path)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 7
    out = plot_run(tmp_path)
    assert out == tmp_path / "training_curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_cli(tmp_path, capsys):
    _metrics_file(tmp_path)
    assert cli_main(["plot", str(tmp_path), "--out", str(tmp_path / "x" / "c.png")]) == 0
    assert (tmp_path / "x" / "c.png").stat().st_size > 10_000
    # missing metrics.jsonl: a clear error, exit 1
    assert cli_main(["plot", str(tmp_path / "nope")]) == 1
    assert "metrics.jsonl" in capsys.readouterr().err


def test_plot_notes_a_kl_that_was_never_computed():
    from torchtune_grpo.metrics.plotting import _panel_note

    kl_panel = [("kl", "kl")]
    no_reference = [{"step": s, "kl": 0.0} for s in (1, 2, 3)]
    assert "kl_coef: 0" in _panel_note(no_reference, kl_panel)
    # a real KL is 0 at step 1 only: drawn, no note
    assert _panel_note([{"step": 1, "kl": 0.0}, {"step": 2, "kl": 1e-4}], kl_panel) is None
    assert _panel_note(no_reference, [("reward/mean", "r")]) is None


def test_plot_without_plottable_metrics_fails(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "other": 1}) + "\n")
    with pytest.raises(ValueError, match="no plottable"):
        plot_run(tmp_path)


# ---------------------------------------------------------------------------- rejection sampling


def test_rejection_sample_keeps_correct_at_most_m_and_loads_in_sft_dataset(tokenizer, rewards, tmp_path):
    prompts = _prompts(tokenizer)
    answers = [p["answer"] for p in prompts]
    engine = AnswerEngine(tokenizer, answers, greedy=[True] * 4, right=[4, 2, 0, 1])
    rows, stats = rejection_sample(torch.nn.Linear(1, 1), tokenizer, engine, prompts, rewards, num_samples=4,
                                   max_new_tokens=16, max_per_prompt=1, threshold=1.0, reward_name="correctness")
    # 4 + 2 + 0 + 1 correct samples; identical texts are kept once, and at most 1 per prompt anyway
    assert stats.passed == 7 and stats.kept == 3 and stats.prompts_kept == 3
    assert all(r["reward"] >= 1.0 for r in rows)
    assert all(f"<answer> {r['answer']} </answer>" in r["response"] for r in rows)
    path = write_jsonl(rows, tmp_path / "rs.jsonl")
    ds = sft_dataset(tokenizer, source="json", data_files=str(path), response_column="response",
                     cache_dir=str(tmp_path / "hf_cache"))
    assert len(ds) == 3
    item = ds[0]
    assert len(item["tokens"]) == len(item["labels"]) and item["tokens"][-1] == tokenizer.eos_id
    # the label span decodes to the kept completion
    resp = [t for t, l in zip(item["tokens"], item["labels"]) if l != -100]
    assert tokenizer.decode(resp, skip_special_tokens=True).strip() == rows[0]["response"].strip()

    # total-reward threshold: format 0.5 alone does not pass 1.0; correct ones score 1.5
    rows, _ = rejection_sample(torch.nn.Linear(1, 1), tokenizer,
                               AnswerEngine(tokenizer, answers, [True] * 4, [4, 2, 0, 1]), prompts, rewards,
                               num_samples=4, max_new_tokens=16, threshold=1.5)
    # 0.5 + 1.0 is exact in fp32; approx's default.
    assert len(rows) == 3 and all(r["reward"] == pytest.approx(1.5) for r in rows)


# --------------------------------------------------------------------- tune-grpo eval / RS (real)


def _tiny_eval_config(tmp_path: Path) -> Path:
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "demo_grpo.yaml")
    cfg.output_dir = str(tmp_path / "out")
    cfg.checkpointer.checkpoint_dir = asset_path("tiny_qwen2")
    cfg.checkpointer.checkpoint_files = ["model.safetensors"]
    cfg.validation.num_samples = 6
    cfg.dataset.num_samples = 3
    cfg.eval_num_samples = 2
    cfg.max_response_length = 6
    path = tmp_path / "eval.yaml"
    OmegaConf.save(cfg, path)
    return path


def test_eval_command_on_a_checkpoint(tmp_path):
    config = _tiny_eval_config(tmp_path)
    out = tmp_path / "eval.json"
    # The installed `tune-grpo` script, run as __main__ in a child forked from this pytest process's fork server
    # (tests/_tune_server.py, which the recipe runs of this file start anyway): the script's own code, its exit
    # code and output, without ~2-4 s of importing torch and torchtune again (a fresh `tune-grpo`:
    # tests/test_wheel.py). The command's environment is this process's, as a plain subprocess's would be.
    from tests.recipe_utils import forked_python

    env = dict(os.environ)
    command = forked_python(
        [TUNE_GRPO, "eval", "--config", str(config), f"checkpoint_dir={asset_path('tiny_qwen2')}", f"json={out}"], env
    )
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval: 100%" in proc.stderr  # the progress bar
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 6 and 0.0 <= result["accuracy"] <= 1.0 and "pass@2" in result
    assert len(result["samples"]) == 6
    assert "accuracy:" in proc.stdout


def test_eval_command_needs_validation(tmp_path, capsys):
    cfg = OmegaConf.load(_tiny_eval_config(tmp_path))
    del cfg["validation"]
    OmegaConf.save(cfg, tmp_path / "noval.yaml")
    assert cli_main(["eval", "--config", str(tmp_path / "noval.yaml")]) == 1
    assert "validation" in capsys.readouterr().err


def test_rejection_sample_command(tmp_path, capsys, one_thread):
    # In process through the same entry point as the `tune-grpo` script (test_eval_command_on_a_checkpoint
    # runs the installed script itself).
    config = _tiny_eval_config(tmp_path)
    out = tmp_path / "rs.jsonl"
    # threshold 0 keeps every finished completion of the random model: the file format is what is tested
    code = cli_main(["rejection-sample", "--config", str(config), f"output={out}", "num_samples=3",
                     "max_per_prompt=2", "threshold=0", "max_response_length=12", "generation.temperature=1.0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "kept" in captured.out and out.is_file()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    per_prompt = {}
    for r in rows:
        per_prompt[r["question"]] = per_prompt.get(r["question"], 0) + 1
        assert set(r) >= {"question", "answer", "prompt", "response", "reward"}
    assert all(v <= 2 for v in per_prompt.values())


# ------------------------------------------------------------------------------ in the recipe


_VALIDATION = {"_component_": "torchtune_grpo.data.arithmetic_dataset", "split": "validation", "num_samples": 8,
               "max_value": 20}
_EVAL = dict(eval_num_samples=2, eval_max_prompts=5, validation=_VALIDATION)


@pytest.mark.slow
def test_recipe_logs_held_out_eval_and_shards_prompts_over_two_ranks(tmp_path, clean_env, one_thread):
    from tests.recipe_utils import read_jsonl, run_in_process, run_tune, write_config

    # One process, in process: eval rows at step 0, every eval_every_n_steps and at the end.
    one = tmp_path / "n1"
    one.mkdir()
    run_in_process(write_config(one, max_steps=3, eval_every_n_steps=2, **_EVAL))
    rows = read_jsonl(one / "out" / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:
        assert 0.0 <= r["eval/accuracy"] <= 1.0 and 0.0 <= r["eval/pass@2"] <= 1.0
        assert math.isfinite(r["eval/reward/mean"]) and r["eval/num_prompts"] == 5
    assert len([r for r in rows if "loss" in r]) == 3  # training rows unchanged

    # Two processes (`tune run`): 5 held-out prompts over 2 ranks (3 + 2). The all-reduced count is 5 and the
    # step-0 greedy accuracy and reward equal the one-process run's (same initial weights, greedy decoding).
    two = tmp_path / "n2"
    two.mkdir()
    run_tune(write_config(two, max_steps=1, **_EVAL), nproc=2, cwd=two)
    two_evals = [r for r in read_jsonl(two / "out" / "metrics.jsonl") if "eval/accuracy" in r]
    assert [r["step"] for r in two_evals] == [0, 1] and two_evals[0]["eval/num_prompts"] == 5
    # (response lengths are not compared: padding differs with the batch split, and the random model's
    # near-tied logits may then pick another token)
    # Greedy accuracy and the mean of rewards that are multiples of 0.5 over the same 5 prompts: exact sums, one
    # float64 division each, the two-rank run's summed in another order (exact). Bound: approx's default 1e-6
    # relative.
    for key in ("eval/accuracy", "eval/reward/mean"):
        assert two_evals[0][key] == pytest.approx(evals[0][key]), key


# ----------------------------------------------------------------------------- the demo configs


def test_demo_sft_config_builds_with_torchtunes_keys(tokenizer, tmp_path):
    # configs/tiny/demo_sft.yaml is for torchtune's full_finetune_single_device (tests/test_configs.py covers
    # the GRPO configs): every key that recipe reads is there, and the dataset builds our SFT data.
    from torchtune import config as tt_config

    from tests.recipe_utils import SFT_RECIPE_KEYS

    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "demo_sft.yaml")
    assert SFT_RECIPE_KEYS <= set(cfg.keys()), SFT_RECIPE_KEYS - set(cfg.keys())
    cfg.asset_dir = asset_path("tiny_qwen2")
    # the rows scripts/demo.sh writes, through the SFT config's dataset
    from torchtune_grpo.data import addition_sft_rows

    rows, _ = addition_sft_rows(50, carry_drop_rate=0.0, seed=0)
    rows.append({"question": "What is 99 + 99?", "reasoning": "9+9=18,9+9+1=19", "answer": "198"})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.dataset.data_files = str(data)
    cfg.dataset.cache_dir = str(tmp_path / "hf_cache")
    OmegaConf.to_container(cfg, resolve=True)
    ds = tt_config.instantiate(cfg.dataset, tokenizer)
    text = tokenizer.decode(ds[len(rows) - 1]["tokens"][:-1])  # without the stop token
    assert text.endswith("<think> 9+9=18,9+9+1=19 </think> <answer> 198 </answer>")
    # SFT and GRPO see the very same prompt tokens for a problem (GRPO's dataset: same problems, same seed).
    grpo = OmegaConf.load(REPO / "configs" / "tiny" / "demo_grpo.yaml")
    grpo.dataset.num_samples = 50
    grpo.max_prompt_length = 64
    prompts = tt_config.instantiate(grpo.dataset, tokenizer)
    assert [p["question"] for p in prompts] == [r["question"] for r in rows[:50]]
    sft_item, grpo_item = ds[0], prompts[0]
    n = len(grpo_item["tokens"])
    assert sft_item["tokens"][:n] == list(grpo_item["tokens"])
    # and the longest worked answer (a carry in both columns) fits GRPO's response budget, stop token included
    longest = len(ds[len(rows) - 1]["tokens"]) - n
    assert longest <= grpo.max_response_length, (longest, grpo.max_response_length)


def test_eval_command_runs_multi_turn_episodes(tmp_path, capsys, one_thread):
    # A multi-turn config (an `environment`) is evaluated on whole episodes, as the recipe's held-out
    # evaluation does (tool_use_rate is reported only for multi-turn evaluation). Weights: the shipped random tiny model (what it answers does not matter here).
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "demo_multi_turn_grpo.yaml")
    cfg.output_dir = str(tmp_path / "out")
    cfg.checkpointer.checkpoint_dir = asset_path("tiny_qwen2")
    cfg.checkpointer.checkpoint_files = ["model.safetensors"]
    cfg.validation.num_samples = 3
    cfg.max_response_length = 24
    config = tmp_path / "eval.yaml"
    OmegaConf.save(cfg, config)
    out = tmp_path / "eval.json"
    code = cli_main(["eval", "--config", str(config), f"json={out}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "tool_use_rate: " in captured.out, captured.out
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 3 and 0.0 <= result["tool_use_rate"] <= 1.0
