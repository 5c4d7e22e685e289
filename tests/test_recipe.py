"""The recipe through its real launch path: `tune run grpo_full_finetune_distributed --config ...`.

Each test writes a copy of the shipped tiny config (tests/_rewards.py explains the extra reward), runs
`tune` in a subprocess from a directory outside the repository (the recipe is an installed module), and
checks what a user gets: metrics, completions, a Hugging Face checkpoint, resumption.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.recipe_utils import (
    REQUIRED_METRICS,
    read_jsonl,
    run_tune,
    tiny_model_from,
    weights,
    write_config,
)
from torchtune_grpo.assets import asset_path


def test_single_process_run(tmp_path):
    cfg = write_config(tmp_path, max_steps=4, save_every_n_steps=2)
    run_tune(cfg, cwd=tmp_path)
    out = tmp_path / "out"

    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert REQUIRED_METRICS <= m.keys(), REQUIRED_METRICS - m.keys()
        assert {"reward/format/mean", "reward/correctness/mean", "reward/vowels/mean"} <= m.keys()
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["time/step"] >= m["time/generation"] > 0
    # The varying reward gives non-zero advantages, hence a real gradient.
    assert any(m["grad_norm"] > 0 for m in metrics)
    # The reference model is the initial policy: KL is 0 before the first update, then positive.
    assert metrics[0]["kl"] < 1e-6 and metrics[-1]["kl"] > 0
    completions = read_jsonl(out / "completions.jsonl")
    assert completions and {"prompt", "completion", "reward", "reward/vowels"} <= completions[0].keys()

    for step in (2, 4):
        assert (out / f"step_{step}" / "recipe_state.pt").is_file()
    final = out / "step_4"
    base = weights(Path(asset_path("tiny_qwen2")))
    trained = weights(final)
    assert base.keys() == trained.keys()
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert len(changed) > len(base) // 2, f"only {changed} changed"

    # The checkpoint is a Hugging Face model directory with the same logits as torchtune's model.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(final, torch_dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([hf_tok.encode("What is 3 + 4? <answer>7</answer>")])
    tt_model = tiny_model_from(final, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, tt_model(ids), atol=1e-4, rtol=1e-4)


def test_resume_matches_uninterrupted_run(tmp_path):
    # seed: null draws a random seed; the resumed run must take the checkpoint's (it fixes data order).
    cfg = write_config(tmp_path, max_steps=4, save_every_n_steps=2, seed=None)
    run_tune(cfg, cwd=tmp_path)
    out = tmp_path / "out"
    uninterrupted = weights(out / "step_4")

    # Simulate a crash right after the step-2 checkpoint: drop everything written later.
    shutil.rmtree(out / "step_4")
    metrics = read_jsonl(out / "metrics.jsonl")[:2]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))

    log = run_tune(cfg, "resume_from_checkpoint=True", cwd=tmp_path)
    assert "Resuming from" in log and "step_2" in log
    steps = [m["step"] for m in read_jsonl(out / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]
    resumed = weights(out / "step_4")
    # Same data order (mid-epoch), same RNG streams, same optimizer and LR state: same weights.
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], atol=1e-6, rtol=1e-5)


def test_resume_without_checkpoint_is_an_error(tmp_path):
    cfg = write_config(tmp_path, max_steps=1)
    with pytest.raises(AssertionError, match="holds no complete checkpoint: no step_N directories"):
        run_tune(cfg, "resume_from_checkpoint=True", cwd=tmp_path)


@pytest.mark.slow
def test_two_processes(tmp_path):
    # The recipe leaves with os._exit(0) once everything is flushed when launched by torchrun, which
    # sidesteps gloo's occasional abort at teardown (shared/DESIGN.md); the exit code is judged as is.
    cfg = write_config(tmp_path, max_steps=2, batch_size=2)
    log = run_tune(cfg, nproc=2, cwd=tmp_path)
    assert "2 rank(s)" in log
    out = tmp_path / "out"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(REQUIRED_METRICS <= m.keys() for m in metrics)
    trained = weights(out / "step_2")
    base = weights(Path(asset_path("tiny_qwen2")))
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(out / "step_2").eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, tiny_model_from(out / "step_2", tmp_path)(ids), atol=1e-4, rtol=1e-4)


def test_unknown_key_is_named(tmp_path):
    cfg = write_config(tmp_path, max_steps=1)
    with pytest.raises(AssertionError, match="Unknown config key\\(s\\): 'lerning_rate'"):
        run_tune(cfg, "lerning_rate=0.1", cwd=tmp_path)


def test_ppo_epochs_without_reference_model(tmp_path):
    cfg = write_config(tmp_path, max_steps=2, ppo_epochs=2, micro_batch_size=4, kl_coef=0.0)
    log = run_tune(cfg, cwd=tmp_path)
    assert "Reference model: none (kl_coef = 0)" in log
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert all(m["kl"] == 0.0 for m in metrics)
    # The second optimizer step on the same rollouts is off-policy: ratios move away from 1.
    assert any(abs(m["ratio_mean"] - 1.0) > 1e-7 for m in metrics)
    # Two optimizer steps per rollout step: the schedule advanced 4 times over 2 steps (warmup 1).
    assert math.isfinite(metrics[-1]["loss"])
