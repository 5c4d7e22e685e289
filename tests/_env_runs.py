"""Checks shared by the ecosystem adapters' tests: resume equals the uninterrupted run, and 2 processes.

Each config is written by its test (output_dir in tmp_path, ``max_steps`` 4, a checkpoint every 2 steps). The
resume check is a claim about numbers (the same rewards and weights), so its two runs go in this process
(``run_in_process``: the recipe's own ``setup``/``train``/``cleanup``, without two ``tune run`` start-ups of
10-20 s each); the 2-process check stays a real ``tune run --nproc_per_node 2`` (launcher, gloo group, servers
per process), each adapter's end-to-end run.
"""

import json
import math
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from tests.recipe_utils import read_jsonl, run_in_process, run_tune, weights


def write(cfg, tmp_path: Path, name: str = "config.yaml", **overrides) -> Path:
    """Saves ``cfg`` with ``overrides`` (dotted keys) as ``tmp_path/name``."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    path = tmp_path / name
    OmegaConf.save(cfg, path)
    return path


def check_resume_equals_uninterrupted(cfg, tmp_path: Path) -> None:
    """4 steps in one go; then, as if killed after the step-2 checkpoint, resumed: the same rewards for steps 3
    and 4 (the prompts, hence the episodes' seeds and tasks, are restored with the data order) and the same
    final weights."""
    out = tmp_path / "out"
    run_in_process(write(cfg, tmp_path, max_steps=4, save_every_n_steps=2, output_dir=str(out)))
    metrics = read_jsonl(out / "metrics.jsonl")
    uninterrupted = weights(out / "step_4")
    shutil.rmtree(out / "step_4")
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics[:2]))
    resume = write(cfg, tmp_path, "resume.yaml", max_steps=4, save_every_n_steps=2, output_dir=str(out),
                   resume_from_checkpoint=True)
    run_in_process(resume)
    resumed = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for before, after in zip(metrics[2:], resumed[2:]):
        assert after["reward/mean"] == before["reward/mean"], (before, after)
    # A resumed run repeats the uninterrupted computation from state restored bit for bit, with the same kernels and
    # shapes: expected bitwise equal, as the in-process resumes are (tests/test_recipe.py, exact there). These
    # environment runs (vLLM engines, servers) have not been run under every CPU capability, so the former bound stays:
    # 1e-6 + 1e-5 relative (~100 ulp of weights <~ 1, far below one update's change).
    for key, value in weights(out / "step_4").items():
        torch.testing.assert_close(value, uninterrupted[key], atol=1e-6, rtol=1e-5)


def check_two_processes(cfg, tmp_path: Path) -> list:
    """Two steps on 2 processes (``tmp_path/out2``): finite loss, every rank's metric keys agreed (the run would
    stop otherwise). Returns the training steps' metrics (evaluation rows, if any, stay in the file)."""
    out = tmp_path / "out2"
    run_tune(write(cfg, tmp_path, "two.yaml", max_steps=2, save_every_n_steps=2, output_dir=str(out)), nproc=2,
             cwd=tmp_path)
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2] and all(math.isfinite(m["loss"]) for m in steps)
    return steps
