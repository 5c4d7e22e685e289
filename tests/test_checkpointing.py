"""Checkpoint saves that never lose the newest complete checkpoint, recovery after a kill, pruning, and the
log rewind on resume (torchtune_grpo/checkpoints/storage.py, torchtune_grpo/metrics/run_logs.py). In process: a kill is
simulated by an exception at a crash point; tests/test_distributed_runs.py kills real runs."""

import json

import pytest
import torch

import torchtune_grpo.checkpoints.storage as ckpt
from torchtune_grpo.metrics.run_logs import rewind_jsonl


class Killed(Exception):
    pass


def _save(out, step, payload, monkeypatch=None, kill_at=None):
    """One save as the recipe does it: model file in staging, then publish; optionally 'killed' at a point."""
    if kill_at is not None:
        def crash(name, at):
            if name == kill_at:
                raise Killed(name)
        monkeypatch.setattr(ckpt, "crash_point", crash)
    staging = ckpt.begin_step_dir(str(out), step)
    staging.mkdir(parents=True)
    (staging / "model.txt").write_text(payload)
    return ckpt.publish_step_dir(str(out), staging, step, {"step": step, "payload": payload})


def _names(out):
    return sorted(p.name for p in out.iterdir())


def test_save_publishes_only_complete_checkpoints(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    _save(out, 2, "w2")
    # Killed mid-save of step 4: model written, recipe state not; step_2 stays the one to resume from.
    with pytest.raises(Killed):
        _save(out, 4, "w4", monkeypatch, kill_at="save")
    assert _names(out) == [".step_4.staging", "step_2"]
    assert ckpt.find_latest_checkpoint(str(out)) == out / "step_2"
    assert ckpt.recover_interrupted_saves(str(out)) == [
        "removed the incomplete interrupted save .step_4.staging"
    ]
    assert _names(out) == ["step_2"]


def test_resaving_a_step_keeps_a_complete_copy_at_every_point(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    _save(out, 6, "old")
    # Re-save step 6 (a finished run resumed), killed between moving the old step_6 aside and renaming
    # the new one into place: no step_6 for that moment, but the new one is complete in staging.
    with pytest.raises(Killed):
        _save(out, 6, "new", monkeypatch, kill_at="replace")
    assert _names(out) == [".step_6.old", ".step_6.staging"]
    assert ckpt.recover_interrupted_saves(str(out)) == [
        "published the complete interrupted save .step_6.staging as step_6",
        "removed .step_6.old (replaced or pruned)",
    ]
    latest = ckpt.find_latest_checkpoint(str(out))
    assert latest == out / "step_6" and (latest / "model.txt").read_text() == "new"
    assert torch.load(latest / ckpt.RECIPE_STATE_FILE)["payload"] == "new"
    # Uninterrupted, the re-save replaces it in place and leaves nothing behind.
    monkeypatch.undo()
    _save(out, 6, "newer")
    assert _names(out) == ["step_6"] and (out / "step_6" / "model.txt").read_text() == "newer"


def test_keep_last_n_prunes_older_complete_checkpoints_after_the_new_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _save(out, 9, "another run's")  # a later step from an earlier run in the same directory: untouched
    for step in (1, 2, 3):
        _save(out, step, f"w{step}")
        removed = ckpt.prune_step_dirs(str(out), step, keep_last_n=2)
        # keep 2: step and the one before it; at step 3 only step_1 goes
        assert removed == ([out / "step_1"] if step == 3 else [])
    assert _names(out) == ["step_2", "step_3", "step_9"]
    assert ckpt.prune_step_dirs(str(out), 3, keep_last_n=None) == []
    assert ckpt.prune_step_dirs(str(out), 3, keep_last_n=1) == [out / "step_2"]
    assert _names(out) == ["step_3", "step_9"]


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_keep_last_n_checkpoints_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=rf"keep_last_n_checkpoints must be an integer >= 1 or null .* got {value!r}"):
        ckpt.checkpoint_retention(value)
    assert ckpt.checkpoint_retention(None) is None and ckpt.checkpoint_retention(3) == 3


def test_rewind_keeps_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 0, "eval/accuracy": 0.1},
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 2, "eval/accuracy": 0.2},  # logged after the step-2 save: the resumed run logs it again
        {"step": 3, "loss": 3.0},           # trained again after resuming at step 2
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo')  # cut by the kill
    assert rewind_jsonl(path, 2) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]
    assert rewind_jsonl(path, 2) == 0  # idempotent
    assert rewind_jsonl(tmp_path / "missing.jsonl", 2) == 0


def test_resumed_schedule_takes_the_new_run_length():
    # A 2-step cosine run (1 warm-up step) ends at lr 0; resumed with 3 steps, the next step's rate is the new
    # schedule's at step 2: progress (2 - 1) / (3 - 1) = 0.5 -> 0.5 * (1 + cos(pi / 2)) = 0.5, so 1e-3 * 0.5.
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    def schedule(total):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1e-3)
        return opt, get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=total)

    opt, sched = schedule(2)
    for _ in range(2):
        opt.step()
        sched.step()
    # The schedule is float64 python: 1e-3 x 0.5 (1 + cos(pi)) with cos(pi) = -1 exactly gives 0 (or 1e-19 from a
    # rounded cos); 1e-3 x 0.5 (1 + cos(pi/2)), cos(pi/2) = 6e-17, is 5e-4 to 1e-16 relative. No torch kernel
    # enters. Bounds: 1e-12 absolute at 0, approx's default 1e-6 relative at 5e-4.
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    opt_state, sched_state = opt.state_dict(), sched.state_dict()

    opt, sched = schedule(3)
    opt.load_state_dict(opt_state)  # what a resume restores: the rate the old schedule set, 0
    sched.load_state_dict(sched_state)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    ckpt.restart_lr_schedule(sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    sched.step()  # and the schedule goes on from there: step 3 of 3 -> 0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_schedulers_without_a_closed_form_are_left_as_restored():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.param_groups[0]["lr"] = 0.025
    ckpt.restart_lr_schedule(sched)
    assert opt.param_groups[0]["lr"] == 0.025


# ------------------------------------------------------------------------ CheckpointManager (the recipe's)


def _writer(fail_at=None):
    def write(model_state, staging, step):
        staging.mkdir(parents=True)
        (staging / "model.txt").write_text(model_state["w"])
        if step == fail_at:
            raise RuntimeError("unexpected pos 128 vs 64")
    return write


def test_manager_saves_when_due_writes_prunes_and_resumes(tmp_path):
    from torchtune_grpo.checkpoints.manager import CheckpointManager

    manager = CheckpointManager(str(tmp_path), _writer(), save_every_n_steps=3, keep_last_n=2)
    # Periodic saves at 3 and 6 of 7 steps; the final step is saved by the caller, once.
    assert [s for s in range(1, 8) if manager.is_due(s, 7)] == [3, 6]
    assert not CheckpointManager(str(tmp_path), _writer()).is_due(3, 7)  # no period: final only
    for step in (3, 6, 7):
        saved = manager.write(step, {"w": f"w{step}"}, {"step": step})
    assert saved.directory == tmp_path / "step_7" and saved.removed == [tmp_path / "step_3"]
    assert _names(tmp_path) == ["step_6", "step_7"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 9)))
    point, done = manager.resume_point(cut_logs=True)
    assert point.step == 7 and point.state == {"step": 7}
    assert done == ["Resuming at step 7: removed 1 later record(s) from metrics.jsonl"]


def test_manager_cleans_up_a_failed_write_and_keeps_the_previous_checkpoint(tmp_path):
    from torchtune_grpo.checkpoints.manager import CheckpointManager

    discarded = []
    manager = CheckpointManager(str(tmp_path), _writer(fail_at=4), keep_last_n=1, discard_partial=discarded.append)
    manager.write(2, {"w": "w2"}, {"step": 2})
    with pytest.raises(OSError, match=r"Failed writing the checkpoint of step 4 to .*\.step_4\.staging: RuntimeError: "
                       r"unexpected pos 128 vs 64\. .*the complete checkpoints \(step_2\) are intact"):
        manager.write(4, {"w": "w4"}, {"step": 4})
    assert discarded == [4] and _names(tmp_path) == ["step_2"]  # no staging left, nothing pruned
