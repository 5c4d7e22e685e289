"""Whole runs through the real launcher (`tune run` in subprocesses) against uninterrupted references:

- killed with SIGKILL at named points (torchtune_grpo/crash_points.py) and resumed, on 1 and 2 processes:
  the resumed run ends with the reference's weights and metrics, and metrics.jsonl holds each step once.

The kill points are spread over the process counts to keep this file to a few tiny runs.
"""

import math
import signal
import subprocess

import pytest
import torch

from torchtune_grpo.crash_points import CRASH_ENV
from tests.recipe_utils import read_jsonl, run_tune, tune_command, tune_env, weights, write_config

STEPS = 4
# Saves at steps 2 and 4; keep_last_n_checkpoints=1 removes step_2 once step_4 is complete.
OVERRIDES = dict(max_steps=STEPS, save_every_n_steps=2, keep_last_n_checkpoints=1)
NOT_COMPARED = ("time/", "tokens_per_second")  # wall-clock measurements


def _reference(tmp_path_factory, nproc: int):
    tmp = tmp_path_factory.mktemp(f"reference_{nproc}proc")
    cfg = write_config(tmp, **OVERRIDES)
    run_tune(cfg, nproc=nproc, cwd=tmp)
    return tmp / "out"


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory):
    return _reference(tmp_path_factory, nproc=1)


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    return _reference(tmp_path_factory, nproc=2)


def run_killed(cfg, crash_at: str, *overrides: str, nproc: int, cwd) -> str:
    """A `tune run` that SIGKILLs rank 0 at ``crash_at`` (``point:step``); asserts it died there."""
    proc = subprocess.run(
        tune_command(cfg, *overrides, nproc=nproc), cwd=cwd, env=tune_env(**{CRASH_ENV: crash_at}),
        capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    if nproc == 1:  # the recipe runs inside the `tune` process itself
        assert proc.returncode == -signal.SIGKILL, f"{crash_at}: rc {proc.returncode}\n{output[-4000:]}"
    else:  # torchrun reports its worker's death and stops the other rank
        assert proc.returncode != 0 and "Signal 9 (SIGKILL)" in output, f"{crash_at}:\n{output[-4000:]}"
    return output


def assert_same_run(out, reference) -> None:
    """Same final weights and per-step metrics as ``reference``; each step logged once; one checkpoint."""
    assert sorted(p.name for p in out.iterdir() if "step_" in p.name) == [f"step_{STEPS}"]
    final, expected = weights(out / f"step_{STEPS}"), weights(reference / f"step_{STEPS}")
    assert final.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], atol=1e-6, rtol=1e-5)
    metrics, ref_metrics = read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for got, want in zip(metrics, ref_metrics):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if not key.startswith(NOT_COMPARED):
                assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6), (got["step"], key)
    assert [c["step"] for c in read_jsonl(out / "completions.jsonl")] == [
        c["step"] for c in read_jsonl(reference / "completions.jsonl")
    ]


@pytest.mark.slow
def test_one_process_killed_between_saves_and_mid_save_resumes_exactly(tmp_path, one_process_reference):
    cfg = write_config(tmp_path, **OVERRIDES)
    out = tmp_path / "out"
    # Between saves: step_2 saved, step 3 trained and logged, then killed.
    run_killed(cfg, "logged:3", nproc=1, cwd=tmp_path)
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    # Resumed from step_2 and killed mid-save of step 4 (model files written, not yet complete).
    log = run_killed(cfg, "save:4", "resume_from_checkpoint=True", nproc=1, cwd=tmp_path)
    assert "Resuming from" in log and "removed 1 later record(s) from metrics.jsonl" in log
    assert (out / ".step_4.staging").is_dir() and (out / "step_2" / "recipe_state.pt").is_file()
    # Resumed from step_2 again: the incomplete save is removed, the run finishes.
    log = run_tune(cfg, "resume_from_checkpoint=True", cwd=tmp_path)
    assert "removed the incomplete interrupted save .step_4.staging" in log
    assert_same_run(out, one_process_reference)
    # (A kill while re-saving a step that has a checkpoint: tests/test_checkpointing.py.)


@pytest.mark.slow
def test_two_processes_killed_mid_rollout_and_mid_update_resume_exactly(tmp_path, two_process_reference):
    cfg = write_config(tmp_path, **OVERRIDES)
    out = tmp_path / "out"
    # Mid-rollout of step 3 (rollouts scored, nothing trained): step_2 is the checkpoint.
    run_killed(cfg, "rollout:3", nproc=2, cwd=tmp_path)
    # Resumed, then killed mid-update of step 4 (optimizer stepped, step 4 not logged).
    log = run_killed(cfg, "update:4", "resume_from_checkpoint=True", nproc=2, cwd=tmp_path)
    assert "Resuming from" in log and "step_2" in log
    run_tune(cfg, "resume_from_checkpoint=True", nproc=2, cwd=tmp_path)
    assert_same_run(out, two_process_reference)

