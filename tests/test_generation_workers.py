"""Generation workers (torchtune_grpo/workers/client.py, workers/process.py): rollouts from a process of their
own at a bounded staleness, deterministic, resumable, and stopped with a named error when the worker dies."""

import os
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipe_utils import (
    launch_command, read_jsonl, recipe_in_process, run_in_process, tune_command, weights, with_overrides,
    write_config,
)
from tests._spawn_runs import launch, Run
from tests.conftest import REPO
from torchtune_grpo.config.schema import LoRARecipeConfig, RecipeConfig
from torchtune_grpo.generation import WeightSyncError
from torchtune_grpo.workers.config_checks import check_generation_workers
from torchtune_grpo.training.step import staleness_metrics, staleness_sums
from torchtune_grpo.workers.client import start_context, WorkerError
from torchtune_grpo.workers.process import adopt_trainer_context, TrainerStdio

COMPARED = ("reward/mean", "loss", "grad_norm", "kl", "entropy")


def _workers(k: int) -> dict:
    return {"enabled": True, "max_staleness": k}


def _metrics(out: Path):
    return [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def test_staleness_counts_by_hand():
    sums = staleness_sums([4, 4, 3, 3, 3, 5], step=5, max_staleness=2)
    assert sums[("staleness", 0)] == 1 and sums[("staleness", 1)] == 2 and sums[("staleness", 2)] == 3
    reduced = {k: v for k, v in sums.items()}
    metrics = staleness_metrics(reduced, 2)
    assert metrics["staleness/max"] == 2
    # Ratios of exact counts in float64 (one rounding): approx's default 1e-6 relative.
    assert metrics["staleness/mean"] == pytest.approx((0 * 1 + 1 * 2 + 2 * 3) / 6)
    assert metrics["staleness/fraction_2"] == pytest.approx(0.5)
    with pytest.raises(RuntimeError, match="3 steps behind at step 6: bound 2"):
        staleness_sums([2], step=5, max_staleness=2)
    # In-flight updates: rows report their oldest token's version; tokens newer than it are counted.
    sums = staleness_sums([3, 4], step=5, max_staleness=2, token_versions=[[3, 3, 4, 5], [4, 4]])
    metrics = staleness_metrics({k: v for k, v in sums.items()}, 2)
    assert metrics["staleness/max"] == 2 and metrics["staleness/newer_token_fraction"] == pytest.approx(2 / 6)
    assert "staleness/newer_token_fraction" not in staleness_metrics(
        dict(staleness_sums([3], step=5, max_staleness=2).items()), 2)


def test_settings_that_workers_do_not_support_are_refused_by_name(tmp_path):
    cfg = OmegaConf.load(write_config(tmp_path, generation_workers={"enabled": True, "max_staleness": -1}))
    with pytest.raises(ValueError, match=r"generation_workers.max_staleness must be >= 0"):
        RecipeConfig.from_cfg(cfg)

    class Engine:
        holds_weights = False

    Engine.holds_weights = True
    lora = LoRARecipeConfig.from_cfg(OmegaConf.load(write_config(
        tmp_path, base=REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", generation_workers=_workers(1)
    )))
    with pytest.raises(ValueError, match="generation_workers.enabled with Engine in the LoRA recipe is not supported"):
        check_generation_workers(lora, Engine())
    check_generation_workers(RecipeConfig.from_cfg(OmegaConf.load(write_config(tmp_path, generation_workers=_workers(1)))),
                             Engine())  # the full recipe takes it (vLLM in the worker)

    # In-flight weight updates need workers, an engine that takes weights while it generates, single turns.
    def full(**workers):
        return RecipeConfig.from_cfg(OmegaConf.load(write_config(tmp_path, generation_workers=workers)))

    with pytest.raises(ValueError, match="generation_workers.in_flight_updates needs generation_workers.enabled"):
        check_generation_workers(full(enabled=False, in_flight_updates=True), Engine())
    with pytest.raises(ValueError, match="in_flight_updates needs an engine that takes weights while it generates.*"
                                         "Engine does not"):
        check_generation_workers(full(enabled=True, in_flight_updates=True), Engine())
    Engine.supports_in_flight_updates = True
    check_generation_workers(full(enabled=True, in_flight_updates=True), Engine())
    multi_turn = RecipeConfig.from_cfg(OmegaConf.load(write_config(
        tmp_path, base=REPO / "configs" / "tiny" / "multi_turn_cpu.yaml",
        generation_workers={"enabled": True, "in_flight_updates": True})))
    with pytest.raises(ValueError, match="in_flight_updates is single-turn only"):
        check_generation_workers(multi_turn, Engine())


def test_a_cuda_worker_where_there_is_no_gpu_stops_the_run_naming_the_key(tmp_path, clean_env, one_thread):
    config = write_config(tmp_path, max_steps=1, save_every_n_steps=None,
                          generation_workers={**_workers(1), "device": "cuda", "restarts": 0})
    if torch.cuda.is_available():  # the GPU check: the worker samples there, as the trainer does on CPU
        run_in_process(config)
        assert _metrics(tmp_path / "out")[0]["staleness/max"] == 0
        return
    with pytest.raises(WorkerError, match="generation_workers.device is 'cuda' but this worker's process sees no CUDA"):
        run_in_process(config)


def _sync_and_worker(tmp_path: Path, config, steps: int, **overrides):
    """The same run synchronous and through a worker at ``max_staleness: 0``: ``(metrics, final weights)`` of
    each. ``config(directory, **overrides)`` writes a run's config."""
    runs = {}
    for name, extra in (("sync", {}), ("worker", {"generation_workers": _workers(0)})):
        (tmp_path / name).mkdir()
        run_in_process(config(tmp_path / name, max_steps=steps, save_every_n_steps=None, **overrides, **extra))
        runs[name] = (_metrics(tmp_path / name / "out"), weights(tmp_path / name / "out" / f"step_{steps}"))
    return runs["sync"], runs["worker"]


def test_staleness_0_through_a_worker_is_the_synchronous_run(tmp_path, clean_env, one_thread):
    # The worker samples with the trainer's weights of the same version, from the same RNG stream, and scores
    # its tokens with the same forward: the run is the synchronous one, number for number.
    (sync, sync_w), (worker, worker_w) = _sync_and_worker(tmp_path, write_config, 3)
    for a, b in zip(sync, worker):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}
        assert b["staleness/max"] == 0 and b["generation/logprob_mismatch"] == 0.0
    assert all(torch.equal(sync_w[k], worker_w[k]) for k in sync_w)


def _dynamic(tmp_path: Path, **overrides) -> Path:
    # Half of the prompts get a zero-variance reward (tests/_rewards.py): dynamic sampling drops their groups
    # and takes more batches; 24 prompts / batch 4 = 6 batches per epoch, so the extra ones roll over epochs.
    return write_config(
        tmp_path, vowel_reward=False, reward_functions=[{"_component_": "tests._rewards.HalfPromptsVowelReward"}],
        dynamic_sampling={"enabled": True, "max_rounds": 3}, **{"dataset.num_samples": 24}, **overrides,
    )


def test_dynamic_sampling_through_a_worker_at_staleness_0_is_the_synchronous_run(tmp_path, clean_env, one_thread):
    # The extra batches are requested when needed, with the current weights, in the stream's order: the
    # synchronous recipe's rounds, number for number.
    (sync, sync_w), (worker, worker_w) = _sync_and_worker(tmp_path, _dynamic, 3)
    assert sum(m["dynamic_sampling/rounds"] for m in sync) > len(sync)  # extra rounds ran
    keys = COMPARED + ("dynamic_sampling/rounds", "dynamic_sampling/groups_dropped")
    assert [{k: m[k] for k in keys} for m in worker] == [{k: m[k] for k in keys} for m in sync]
    assert all(m["staleness/max"] == 0 for m in worker)
    assert all(torch.equal(sync_w[k], worker_w[k]) for k in sync_w)


def test_dynamic_sampling_one_step_off_stays_bounded_and_resumes_exactly(tmp_path, clean_env, one_thread):
    # Extra batches come from the prefetch first; the pipeline is refilled with the new weights after the
    # update. A checkpoint keeps how many batches were taken, so a resume continues the same stream.
    cfg = _dynamic(tmp_path, max_steps=4, save_every_n_steps=2, generation_workers=_workers(1))
    run_in_process(cfg)
    out = tmp_path / "out"
    first = _metrics(out)
    assert sum(m["dynamic_sampling/rounds"] for m in first) > len(first)
    assert all(m["staleness/max"] <= 1 for m in first) and any(m["staleness/max"] == 1 for m in first)
    uninterrupted = weights(out / "step_4")
    shutil.rmtree(out / "step_4")  # resume from step 2's checkpoint, its batches in flight restored
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines()[:2]))
    run_in_process(with_overrides(cfg, resume_from_checkpoint=True))
    keys = COMPARED + ("dynamic_sampling/rounds", "staleness/max")
    assert [{k: m[k] for k in keys} for m in _metrics(out)] == [{k: m[k] for k in keys} for m in first]
    resumed = weights(out / "step_4")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


WEIGHT_SYNC = {"_component_": "torchtune_grpo.generation.WeightSyncCheck", "every_n_syncs": 1, "tolerance": 1e-3}


def _copy_engine(name: str) -> dict:
    return {"generation": {"_component_": f"tests._copy_engines.{name}", "model": "${model}"}, "weight_sync": WEIGHT_SYNC}


def test_an_engine_holding_its_own_weights_runs_in_the_worker_as_in_the_trainer(tmp_path, clean_env, one_thread):
    # CopyGenerator holds its own weights as vLLM does: in the worker it is the only copy (the worker builds no
    # model), each version goes into it through load_weights, and the probe check scores it there. At
    # max_staleness 0 the run is the synchronous one with the same engine, number for number.
    (sync, sync_w), (worker, worker_w) = _sync_and_worker(tmp_path, write_config, 2, **_copy_engine("CopyGenerator"))
    assert [{k: m[k] for k in COMPARED} for m in worker] == [{k: m[k] for k in COMPARED} for m in sync]
    assert all(torch.equal(sync_w[k], worker_w[k]) for k in sync_w)


def test_a_worker_engine_whose_sync_is_broken_stops_the_run(tmp_path, clean_env, one_thread):
    # The worker scores the probe with the weights its engine holds: a sync that never reaches it is caught.
    config = write_config(tmp_path, max_steps=3, save_every_n_steps=None, lr_scheduler=None,  # step 1 moves
                          generation_workers=_workers(0), **_copy_engine("StaleCopyGenerator"))
    with pytest.raises(WeightSyncError, match="Weight sync check failed after step 1"):
        run_in_process(config)


def _prompts_by_step(out: Path):
    steps = {}
    for row in read_jsonl(out / "completions.jsonl"):
        steps.setdefault(row["step"], []).append(row["prompt"])
    return {s: sorted(set(p)) for s, p in steps.items()}


# One step off, 8 prompts, 2 per step: steps 1-4 are one epoch; checkpoints at steps 2 and 4.
ONE_STEP_OFF = dict(max_steps=4, save_every_n_steps=2, log_completions=64, generation_workers=_workers(1), batch_size=2,
                    **{"dataset.num_samples": 8})


@pytest.fixture(scope="module")
def one_step_off_run(tmp_path_factory):
    """The uninterrupted ONE_STEP_OFF run, in this process (the reference of the killed runs below): its output
    directory and its log messages."""
    tmp = tmp_path_factory.mktemp("one_step_off")
    log: list = []
    run_in_process(write_config(tmp, **ONE_STEP_OFF), log=log)
    return tmp / "out", log


def test_one_step_off_is_deterministic_bounded_and_resumes_exactly_after_sigkill(tmp_path, clean_env, one_thread,
                                                                                 one_step_off_run):
    # 8 prompts, 2 per step: steps 1-4 are one epoch. Uninterrupted, then killed after step 3 (batch 4 in
    # flight; no step-3 checkpoint: save_every 2) and resumed from step 2's checkpoint, whose in-flight batches
    # 3 and 4 come from the checkpoint, not from new samples. Equal numbers in separate processes: deterministic
    # (steps 1-3 and the step-2 checkpoint come from the killed `tune run`, a real launch: SIGKILL ends the
    # process). The uninterrupted run and the resume are judged by their numbers only: in this process.
    done = {"a": one_step_off_run[0]}
    (tmp_path / "killed").mkdir()
    config = write_config(tmp_path / "killed", **ONE_STEP_OFF)
    # Forked from the tests' tune server (tests/_tune_server.py): a real `tune run` and its SIGKILL, without the
    # interpreter's ~6 s of imports (tests/test_recipe.py keeps fresh-interpreter runs).
    command, env = launch_command(tune_command(config), TORCHTUNE_GRPO_CRASH_AT="logged:3")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    log: list = []
    run_in_process(with_overrides(config, resume_from_checkpoint=True), log=log)
    assert any("rollouts in flight restored" in line for line in log), log
    done["resumed"] = tmp_path / "killed" / "out"

    a = _metrics(done["a"])
    assert [m["staleness/max"] for m in a] == [0, 1, 1, 1]  # batches 1 and 2 both from the initial weights
    assert all(m["staleness/fraction_1"] == (0.0 if m["step"] == 1 else 1.0) for m in a)
    for other in ("resumed",):
        assert [{k: m[k] for k in COMPARED} for m in _metrics(done[other])] == [{k: m[k] for k in COMPARED} for m in a]
        assert _prompts_by_step(done[other]) == _prompts_by_step(done["a"])
        wa, wb = weights(done["a"] / "step_4"), weights(done[other] / "step_4")
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Every prompt of the epoch trained exactly once, none dropped or repeated by the kill.
    epoch = Counter(p for s in (1, 2, 3, 4) for p in _prompts_by_step(done["resumed"])[s])
    assert len(epoch) == 8 and set(epoch.values()) == {1}


def test_a_worker_that_dies_is_replaced_and_the_run_continues_unchanged(tmp_path, clean_env, one_thread, one_step_off_run):
    # Killed while batches were in flight: the new worker gets the weights and requests the old one had not
    # answered, from the sampling state after its last answer, so the run ends as an uninterrupted one (the
    # module's ONE_STEP_OFF run).
    reference, reference_log = one_step_off_run
    log: list = []
    with recipe_in_process(write_config(tmp_path, **ONE_STEP_OFF), log=log) as recipe:
        recipe.train_step()
        os.kill(recipe.step.rollouts.pid, signal.SIGKILL)
        recipe.train()
    replaced = "died with exit code -9: starting a new one (1 of 3 restarts)"
    assert replaced in "\n".join(log) and replaced not in "\n".join(reference_log)
    a, b = _metrics(reference), _metrics(tmp_path / "out")
    assert [{k: m[k] for k in COMPARED} for m in a] == [{k: m[k] for k in COMPARED} for m in b]
    wa, wb = weights(reference / "step_4"), weights(tmp_path / "out" / "step_4")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_worker_that_dies_with_no_restarts_left_stops_the_run_naming_it(tmp_path, clean_env, one_thread):
    config = write_config(tmp_path, max_steps=3, save_every_n_steps=None,
                          generation_workers={**_workers(1), "restarts": 0})
    with recipe_in_process(config) as recipe:
        card = (tmp_path / "out" / "algorithm_card.md").read_text()
        assert "at most 1 training step(s) old when trained on (max_staleness = 1)" in card
        assert "nothing corrects for it (set loss.tis_cap or rollout_correction" in card
        pid = recipe.step.rollouts.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"generation worker of rank 0 \(pid {pid}\) died with exit code -9; "
                                              r"generation_workers.restarts = 0 used up"):
            for _ in range(3):
                recipe.train_step()


def test_two_trainer_processes_with_multi_turn_episodes_in_their_workers(tmp_path):
    # One worker per rank, each running tool-use episodes (the environment is built in the worker).
    config = write_config(
        tmp_path, base=REPO / "configs" / "tiny" / "multi_turn_cpu.yaml", max_steps=2, save_every_n_steps=None,
        generation_workers=_workers(1),
    )
    # In one launch of two processes forked from the tests' fork server (tests/_spawn_runs.py): a two-process group as
    # `tune run --nproc_per_node 2` makes it, without the launcher's start-up; what is judged is the run's workers
    # and metrics, not the command line (the ecosystem tests keep two-process `tune run`s).
    launch([Run(two_processes=str(config))])
    metrics = _metrics(tmp_path / "out")
    assert [m["staleness/max"] for m in metrics] == [0, 1]
    assert all(m["episode/turns"] >= 1 and "generation/logprob_mismatch" in m for m in metrics)


def test_qlora_through_a_worker_samples_with_the_trainers_adapter(tmp_path, clean_env, one_thread):
    # The worker builds the LoRA model (the LoRA recipe's config class) and gets base + adapter weights; with
    # QLoRA the base arrives dequantized and stays so (quantizing it again would not give the trainer's
    # values back), so both sample from the same function. (Plain LoRA: the uninterrupted run of
    # test_a_lora_worker_gets_the_base_once_then_only_the_adapters.)
    config = write_config(tmp_path, base=REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", max_steps=2,
                          save_every_n_steps=None, lr_scheduler=None, generation_workers=_workers(0),
                          **{"model.quantize_base": True})
    run_in_process(config, lora=True)
    metrics = _metrics(tmp_path / "out")
    assert [m["generation/logprob_mismatch"] for m in metrics] == [0.0, 0.0]  # the adapter moved after step 1
    assert metrics[1]["grad_norm"] > 0


def test_a_lora_worker_gets_the_base_once_then_only_the_adapters(tmp_path, clean_env, one_thread, monkeypatch):
    # The worker builds the LoRA model (the LoRA recipe's config class) and gets base + adapter weights.
    # The first weights message holds every weight; later ones only the trained adapters (lora_a, lora_b),
    # and the worker still samples from exactly the trainer's model (mismatch 0 at staleness 0). A worker
    # killed after step 1 gets the base again with the next version: the run ends as the uninterrupted one.
    from torchtune_grpo.workers.client import WorkerRollouts

    sent, sizes = [], []  # each weights message's names and element count
    payload = WorkerRollouts._payload

    def recording(self, version):
        state = payload(self, version)
        sent.append(sorted(state))
        sizes.append(sum(t.numel() for t in state.values()))
        return state

    monkeypatch.setattr(WorkerRollouts, "_payload", recording)
    ends = {}
    for name in ("uninterrupted", "killed"):
        (tmp_path / name).mkdir()
        sent.clear()
        sizes.clear()
        config = write_config(tmp_path / name, base=REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", max_steps=3,
                              save_every_n_steps=None, lr_scheduler=None, generation_workers=_workers(0))
        with recipe_in_process(config, lora=True) as recipe:
            recipe.train_step()
            if name == "killed":
                os.kill(recipe.step.rollouts.pid, signal.SIGKILL)
            recipe.train()
        metrics = _metrics(tmp_path / name / "out")
        # The worker samples with the trainer's adapter: mismatch 0 once the adapter has moved (after step 1).
        assert [m["generation/logprob_mismatch"] for m in metrics] == [0.0, 0.0, 0.0]
        assert metrics[1]["grad_norm"] > 0
        ends[name] = ([{k: m[k] for k in COMPARED} for m in metrics], weights(tmp_path / name / "out" / "step_3"))
        full, adapters = set(sent[0]), {k for k in sent[0] if "lora_" in k}
        assert adapters and len(full) > len(adapters)
        with_base = [i for i, keys in enumerate(sent) if set(keys) == full]
        assert all(set(keys) == adapters for i, keys in enumerate(sent) if i not in with_base), sent
        # Versions 0-3; after the kill, version 1 again with the base (to the new worker).
        assert with_base == ([0, 2] if name == "killed" else [0]) and len(sent) == 4 + len(with_base) - 1, (name, sizes)
        assert all(sizes[i] * 10 < sizes[0] for i in range(len(sent)) if i not in with_base), sizes  # 8 % here
    (a, wa), (b, wb) = ends["uninterrupted"], ends["killed"]
    assert a == b and all(torch.equal(wa[k], wb[k]) for k in wa)


def _report_mark(environ: dict, stdio: list) -> None:
    """A stand-in worker target (importable, so a fork server's child finds it): prints GRPO_TEST_MARK."""
    adopt_trainer_context(environ, stdio)
    print(f"GRPO_TEST_MARK={os.environ.get('GRPO_TEST_MARK')}", flush=True)


def test_a_forked_worker_gets_the_trainers_environment_and_stdout_at_its_start(tmp_path, monkeypatch):
    # On a machine without CUDA, CPU workers fork from a fork server started with the first one (cheap restarts);
    # a later worker must still get the trainer's environment and stdout as they are when it starts, as a spawned
    # one does, not the server's (both changed here after the server started). ~0.5 s once the server is up.
    ctx = start_context("cpu")
    assert ctx.get_start_method() == ("spawn" if torch.cuda.is_available() else "forkserver")
    first = ctx.Process(target=_report_mark, args=(dict(os.environ), TrainerStdio()))
    first.start()  # the fork server is up (if an earlier worker in this process has not started it already)
    first.join(120)
    monkeypatch.setenv("GRPO_TEST_MARK", "set after the server started")
    out, saved = tmp_path / "stdout", os.dup(1)
    with open(out, "w") as f:
        os.dup2(f.fileno(), 1)
        try:
            later = ctx.Process(target=_report_mark, args=(dict(os.environ), TrainerStdio()))
            later.start()
            later.join(120)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    assert first.exitcode == later.exitcode == 0
    assert out.read_text() == "GRPO_TEST_MARK=set after the server started\n"
