"""GRPO on every supported architecture's model directory: two steps in-process on one process (Qwen3 also
runs through `tune run` on 1 and 2 processes in test_models_recipe.py, Llama 3.2 on 2 processes below), and
the step directory loads in transformers with our model's logits."""

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.hf_models import ARCHITECTURES, hf_components, make_model_dir
from tests.recipe_utils import read_jsonl, run_tune, write_config
from tests.test_models_recipe import TWO_STEPS, _check_trained_directory


def _config(tmp_path: Path, arch: str) -> Path:
    src = make_model_dir(tmp_path / arch, arch)
    return src, write_config(tmp_path, **hf_components(src), **TWO_STEPS)


@pytest.mark.parametrize("arch", sorted(a for a in ARCHITECTURES if a != "qwen3"))
def test_two_grpo_steps_in_process(arch, tmp_path, clean_env, one_thread):
    from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed

    src, path = _config(tmp_path, arch)
    cfg = OmegaConf.load(path)
    recipe = GRPOFullFinetuneRecipeDistributed(cfg)
    recipe.setup(cfg)
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    _check_trained_directory(src, tmp_path / "out" / "step_2", tmp_path)


@pytest.mark.slow
def test_llama3_2_two_processes(tmp_path):
    src, path = _config(tmp_path, "llama3_2")
    run_tune(path, nproc=2, cwd=tmp_path)
    assert [r["step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r] == [1, 2]
    _check_trained_directory(src, tmp_path / "out" / "step_2", tmp_path)
