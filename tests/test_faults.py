"""Faults a demanding user meets, each with what the run must do (docs/recipe.md, "What survives what"):

- two runs on one ``output_dir``: the second refuses, naming the first (a lock a crashed run cannot leave);
- a diverging run (NaN/inf gradients, loss or weights): it stops naming the step (or skips, as configured),
  and no checkpoint with non-finite weights is ever written, so pruning cannot remove the last finite one;
- an unreadable newest checkpoint on resume: named, and the previous one used (or an error, as configured);
- a disk that fills during a save: "no space left on device" with the path, the partial save removed, the
  previous checkpoints intact and a leftover staging directory removed at the next start.

In-process runs of the tiny config (tests/recipe_utils.py); SIGTERM runs are in tests/test_distributed_runs.py.
"""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config
from torchtune_grpo.checkpoints.storage import RECIPE_STATE_FILE, save_failure
from torchtune_grpo.runtime.nonfinite import NonFiniteError
from torchtune_grpo.runtime.output_lock import LOCK_FILE, OutputDirBusy, OutputDirLock
from torchtune_grpo.checkpoints.resume import config_changes, load_resume_point

# Six steps, a checkpoint after each, the two newest kept; lr 1e6 without clipping makes the gradients of
# step 2 NaN (the weights after step 1 are ~1e6 and overflow in the backward pass).
DIVERGING = dict(max_steps=6, save_every_n_steps=1, keep_last_n_checkpoints=2, lr_scheduler=None, kl_coef=0.0,
                 clip_grad_norm=None, **{"optimizer.lr": 1e6})


def _all_finite(directory: Path) -> bool:
    return all(torch.isfinite(t).all() for t in weights(directory).values())


# ------------------------------------------------------------------------------------------ output_dir lock

_HOLD_LOCK = """
import sys, time
from torchtune_grpo.runtime.output_lock import OutputDirLock
OutputDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_a_busy_output_dir_refuses_and_a_killed_owner_frees_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirBusy, match=rf"output_dir='{tmp_path}' is in use by another run \(host .*, "
                           rf"pid {holder.pid}, started .*, command '-c {tmp_path}'"):
            OutputDirLock(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup: as a crash or an out-of-memory kill
        holder.wait()
    lock = OutputDirLock(str(tmp_path)).acquire()  # the dead owner left the file, not the lock
    assert lock.held and json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    OutputDirLock(str(tmp_path)).acquire().release()  # released: free again


def test_the_recipe_refuses_an_output_dir_another_run_holds(tmp_path, clean_env):
    from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(write_config(tmp_path, max_steps=1))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    other = OutputDirLock(str(out)).acquire()  # another run (this process, another descriptor: flock refuses)
    try:
        recipe = GRPOFullFinetuneRecipeDistributed(cfg)
        with pytest.raises(OutputDirBusy, match=rf"in use by another run \(host .*, pid {os.getpid()}"):
            recipe.setup(cfg)
        # Refused before writing anything: the other run's logs and checkpoints are untouched.
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    finally:
        other.release()


# ------------------------------------------------------------------------------------- non-finite numbers


def test_a_diverging_run_stops_naming_the_step_and_keeps_its_finite_checkpoints(tmp_path, clean_env, one_thread):
    cfg = write_config(tmp_path, **DIVERGING)
    with pytest.raises(NonFiniteError, match=r"The gradient norm is nan at training step 2 .*the optimizer step "
                       r"was not taken\. Usual causes: a learning rate far too high"):
        run_in_process(cfg)
    out = tmp_path / "out"
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_1"]
    assert _all_finite(out / "step_1")


def test_on_nonfinite_skip_drops_the_bad_optimizer_steps_and_saves_finite_weights(tmp_path, clean_env, one_thread):
    cfg = write_config(tmp_path, on_nonfinite="skip", **DIVERGING)
    run_in_process(cfg)
    out = tmp_path / "out"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["nonfinite/skipped_optimizer_steps"] for m in metrics] == [0, 1, 1, 1, 1, 1]
    assert metrics[1]["grad_norm"] == "nan"  # logged as it was, not hidden
    # No step after the first was taken: the two kept checkpoints hold step 1's (finite) weights.
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_5", "step_6"]
    w5, w6 = weights(out / "step_5"), weights(out / "step_6")
    assert all(torch.equal(w5[k], w6[k]) for k in w5) and _all_finite(out / "step_6")


def test_non_finite_weights_stop_the_run_whatever_on_nonfinite_says(tmp_path, clean_env, one_thread):
    # Finite gradients, then an update that puts an inf into a weight (tests/_faults.py): skipping cannot
    # undo it, so the run stops before the step's checkpoint.
    cfg = write_config(tmp_path, max_steps=4, save_every_n_steps=1, on_nonfinite="skip",
                       optimizer={"_component_": "tests._faults.PoisonedAdamW", "lr": 1e-3, "poison_at": 2})
    with pytest.raises(NonFiniteError, match=r"1 weight tensor\(s\) hold NaN or inf after training step 2"):
        run_in_process(cfg)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_1"]
    assert _all_finite(out / "step_1")


# --------------------------------------------------------------------------------------- broken checkpoints


def _fake_checkpoint(out: Path, step: int, state=None) -> Path:
    d = out / f"step_{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"")
    if state is not None:
        torch.save(state, d / RECIPE_STATE_FILE)
    return d


def test_resume_passes_over_unreadable_checkpoints_naming_each(tmp_path):
    _fake_checkpoint(tmp_path, 2, {"step": 2})
    truncated = _fake_checkpoint(tmp_path, 4, {"step": 4, "payload": torch.zeros(1000)})
    blob = (truncated / RECIPE_STATE_FILE).read_bytes()
    (truncated / RECIPE_STATE_FILE).write_bytes(blob[: len(blob) // 2])  # a copy cut short
    _fake_checkpoint(tmp_path, 6)  # recipe_state.pt deleted
    point = load_resume_point(str(tmp_path))
    assert point.directory == tmp_path / "step_2" and point.state == {"step": 2} and point.step == 2
    assert point.notes[0] == (f"{tmp_path / 'step_6'} has no recipe_state.pt (deleted, or not written by this "
                              "recipe): not resumable, resuming from step_2 instead")
    assert point.notes[1].startswith(f"{truncated / RECIPE_STATE_FILE} cannot be read (RuntimeError: ")
    assert len(point.notes) == 2
    with pytest.raises(RuntimeError, match=r"Cannot resume from the newest checkpoint: .*step_6 has no "
                       r"recipe_state\.pt .*Move step_6 out of .* or set on_broken_checkpoint=use_previous"):
        load_resume_point(str(tmp_path), on_broken="error")


def test_a_truncated_newest_recipe_state_resumes_from_the_previous_checkpoint(tmp_path, clean_env, one_thread):
    cfg = write_config(tmp_path, max_steps=4, save_every_n_steps=2)
    run_in_process(cfg)
    out = tmp_path / "out"
    state = out / "step_4" / RECIPE_STATE_FILE
    state.write_bytes(state.read_bytes()[:1000])
    cfg = write_config(tmp_path, max_steps=5, save_every_n_steps=2, resume_from_checkpoint=True)
    lines: list = []
    run_in_process(cfg, log=lines)
    log = "\n".join(lines)
    assert f"{state} cannot be read (" in log and "not resumable, resuming from step_2 instead" in log
    assert f"Resuming from {out / 'step_2'}" in log
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]  # steps 3-4 trained again


# --------------------------------------------------------------------------------------------- full disk


def test_a_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, clean_env, one_thread, monkeypatch):
    import torchtune_grpo.checkpoints.storage as ckpt

    out = tmp_path / "out"
    real_save, real_usage = torch.save, ckpt.shutil.disk_usage

    def save(obj, path, *args, **kwargs):  # the recipe state of step 4 hits a full disk, as PyTorch reports it
        if "step_4" in str(path):
            Path(path).write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1024 vs 512")
        return real_save(obj, path, *args, **kwargs)

    def usage(path):
        total, used, free = real_usage(path)
        return type(real_usage(path))(total, total - 1024, 1024)  # 1 KiB left

    monkeypatch.setattr(ckpt.torch, "save", save)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", usage)
    cfg = write_config(tmp_path, max_steps=4, save_every_n_steps=2)
    with pytest.raises(OSError, match=rf"No space left on device while writing the checkpoint of step 4 to "
                       rf"{out / '.step_4.staging'} \(RuntimeError: .*unexpected pos.*; 0\.0 MiB free\)\. .*The partial "
                       r"checkpoint was removed; the complete checkpoints \(step_2\) are intact") as caught:
        run_in_process(cfg)
    assert caught.value.errno == errno.ENOSPC
    assert not (out / ".step_4.staging").exists() and not (out / "epoch_4").exists()
    assert load_resume_point(str(out)).step == 2
    monkeypatch.undo()
    # A staging directory that a killed save left is removed when the next run starts (fresh or resumed).
    (out / ".step_9.staging").mkdir()
    (out / ".step_9.staging" / "model.safetensors").write_bytes(b"partial")
    lines: list = []
    run_in_process(write_config(tmp_path, max_steps=1, save_every_n_steps=None), log=lines)
    log = "\n".join(lines)
    assert "removed the incomplete interrupted save .step_9.staging" in log
    assert not (out / ".step_9.staging").exists()


def test_a_failed_save_that_is_not_a_full_disk_names_the_path_and_the_error(tmp_path):
    (tmp_path / "step_3").mkdir()
    torch.save({}, tmp_path / "step_3" / RECIPE_STATE_FILE)
    error = save_failure(PermissionError(errno.EACCES, "Permission denied"), str(tmp_path), tmp_path / ".step_6.staging", 6)
    assert error.errno == errno.EACCES
    assert str(error).startswith(f"[Errno {errno.EACCES}] Failed writing the checkpoint of step 6 to "
                                 f"{tmp_path / '.step_6.staging'}: PermissionError")
    assert "the complete checkpoints (step_3) are intact" in str(error)
    full = save_failure(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path), tmp_path / ".s", 6)
    assert full.errno == errno.ENOSPC and "No space left on device while writing" in str(full)


# ------------------------------------------------------------------------------------------ changed config


def test_config_changes_lists_each_changed_setting():
    saved = {"group_size": 4, "optimizer": {"lr": 1e-3, "betas": [0.9, 0.99]}, "resume_from_checkpoint": False,
             "reward_functions": [{"name": "a"}]}
    current = {"group_size": 8, "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95]}, "resume_from_checkpoint": True,
               "reward_functions": [{"name": "a"}, {"name": "b"}], "seed": 1}
    assert config_changes(saved, current) == [
        "group_size: 4 -> 8", "optimizer.betas.1: 0.99 -> 0.95", "reward_functions.1.name: (absent) -> 'b'",
        "seed: (absent) -> 1",
    ]
    assert config_changes(None, current) == []  # a checkpoint from before configs were recorded


def test_a_fresh_start_over_an_earlier_run_says_what_it_will_replace(tmp_path):
    from torchtune_grpo.checkpoints.resume import earlier_run_note

    assert earlier_run_note(str(tmp_path)) is None
    _fake_checkpoint(tmp_path, 3, {"step": 3})
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert earlier_run_note(str(tmp_path)).startswith(
        f"output_dir={str(tmp_path)!r} holds an earlier run (step_3; metrics.jsonl). This fresh start "
        "(resume_from_checkpoint=False) appends to its metrics.jsonl"
    )
