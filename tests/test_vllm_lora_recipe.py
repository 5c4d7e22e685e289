"""``grpo_lora_finetune_distributed`` with the vLLM engine (configs/tiny/lora_vllm_grpo_cpu.yaml), through `tune run`.

- One process, LoRA, adapter sync: 2 steps whose every version checks out (fp32: rounding only), each
  sending the adapter alone; then a run resumed on two processes with ``lora_sync: merge``, whose engines get
  the resumed (trained, non-zero) adapter, merged, before their first rollout: the start-up check compares it
  with the trainer's resumed policy; every sync sends full merged weights gathered from the FSDP2 shards.
- Two processes, QLoRA, multi-turn episodes, ``lora_sync: adapter``: one engine per rank holding the
  dequantised NF4 base plus the adapter, each checked against the trainer's NF4 model (this run also carries
  the one-process QLoRA run's claims, and the adapter-only sync over FSDP2 shards: one engine start-up per
  rank instead of three runs). Its run starts with the module's first test and goes on beside that test's runs
  (they share nothing; the one-process run leaves a core idle).
- A stale adapter sync stops the run after step 1 (in process, with an in-test engine that keeps its own LoRA
  copy and drops adapter versions after the first: no vLLM engine starts for a run meant to stop).

Engine-level checks (adapter-only = merged logprobs, bytes, QLoRA, stale adapter in vLLM itself):
tests/test_vllm_engine.py.
"""

import copy
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

from tests.conftest import REPO
from tests.recipe_utils import BackgroundTune, read_jsonl, run_in_process, run_tune, write_config
from tests.test_vllm_recipe import NudgeEnvironment  # noqa: F401  (the multi-turn run's environment)
from torchtune_grpo.assets import asset_path
from torchtune_grpo.generation import NativeGenerator, WeightSyncError
from torchtune_grpo.models.logprobs import sequence_logprobs

CONFIG = REPO / "configs" / "tiny" / "lora_vllm_grpo_cpu.yaml"
RECIPE = "grpo_lora_finetune_distributed"
# No warm-up: the first optimizer step already moves the adapter.
TRAIN = dict(max_steps=2, lr_scheduler=None)


def _rows(tmp_path: Path):
    return [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]


def _adapter_bytes(cfg_path: Path) -> int:
    """fp32 bytes of every LoRA A and B matrix of the config's model."""
    model = tt_config.instantiate(OmegaConf.load(cfg_path).model)
    return sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)


@pytest.fixture(autouse=True)
def _needs_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: these tests need a real engine (README, Install).")


def _qlora_config(tmp_path: Path) -> Path:
    return write_config(
        tmp_path, base=CONFIG, save_every_n_steps=None, **TRAIN,
        **{"model.quantize_base": True, "dataset.prompt_style": "chat", "generation.lora_sync": "adapter"},
        tokenizer={"_component_": "torchtune_grpo.models.hf_tokenizer", "path": asset_path("tiny_qwen2")},
        environment={"_component_": "tests.test_vllm_recipe.NudgeEnvironment"},
        multi_turn={"max_turns": 3, "env_timeout": 10},
        max_response_length=64,
    )


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """test_qlora_on_two_processes_with_multi_turn_episodes's run (its directory and the run), started when the
    module's first test asks for it: it shares nothing with that test's runs, and runs while they do (the
    one-process run leaves a core idle)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: these tests need a real engine (README, Install).")
    tmp_path = tmp_path_factory.mktemp("qlora_two_processes")
    run = BackgroundTune(_qlora_config(tmp_path), nproc=2, cwd=tmp_path, recipe=RECIPE)
    try:
        yield tmp_path, run
    finally:
        run.stop()


@pytest.mark.slow
def test_lora_syncs_adapters_only_then_resumes_on_two_processes_with_merge(tmp_path: Path, qlora_run):
    # qlora_run: the other test's run, started now so that it runs beside this test's (a separate directory).
    # One process, adapter sync: 2 steps, each sending the adapter alone, then a checkpoint.
    config = write_config(tmp_path, base=CONFIG, save_every_n_steps=2, **TRAIN)
    output = run_tune(config, cwd=tmp_path, recipe=RECIPE)
    assert "Generation engine started, weights synced and checked" in output
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    adapter_bytes = _adapter_bytes(config)
    for r in rows:
        assert r["generation/sync_logprob_diff"] < 1e-4, r  # the new adapter version, fp32
        assert r["generation/logprob_mismatch"] < 1e-4, r  # vLLM sampled from the trainer's policy
        assert r["generation/sync_bytes"] == adapter_bytes, r  # the adapter alone, not the base
    adapter = torch.load(tmp_path / "out" / "step_2" / "adapter_model.pt", weights_only=True)
    assert max(v.abs().max().item() for k, v in adapter.items() if k.endswith("lora_b.weight")) > 1e-3

    # Resumed on two processes with lora_sync: merge (one run for what were two: this resume, formerly on one
    # process, and test_lora_sync_merge_on_two_processes, formerly 2 fresh steps). Each rank's engine starts from
    # the base files; its first sync (before any rollout) must carry the resumed adapter, merged, or the start-up
    # check fails (B != 0 moves the probe's logprobs off the base's). merge: every sync sends every weight with
    # the adapter merged (fp32), gathered from the FSDP2 shards on both ranks: the start-up sync and step 3's.
    # The checks pass and the card says what is sent. (lora_sync: adapter on two processes:
    # test_qlora_on_two_processes_with_multi_turn_episodes.)
    output = run_tune(config, "resume_from_checkpoint=True", "max_steps=3", "generation.lora_sync=merge", nproc=2,
                      cwd=tmp_path, recipe=RECIPE)
    assert "Resuming from" in output and "Generation engine started, weights synced and checked" in output
    assert "2 rank(s)" in output
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    base_bytes = sum(p.numel() * 4 for n, p in tt_config.instantiate(OmegaConf.load(config).model).named_parameters()
                     if "lora_" not in n)
    merged = rows[-1]
    assert merged["generation/sync_logprob_diff"] < 1e-4, merged
    assert merged["generation/logprob_mismatch"] < 1e-4, merged
    assert merged["generation/sync_bytes"] == base_bytes, merged  # every base weight (merged), no adapter
    card = (tmp_path / "out" / "algorithm_card.md").read_text()
    assert "(lora_sync: merge)" in card
    assert "computed in fp32 and cast to float32 once (lora_sync: merge)" in card


@pytest.mark.slow
def test_qlora_on_two_processes_with_multi_turn_episodes(qlora_run):
    # One run for three claims (each used to start its own engines): QLoRA on two processes with multi-turn
    # episodes; the engine holds the NF4 base dequantised as the trainer's forward computes it and the adapter
    # alone follows (formerly also a one-process QLoRA run: the same claims, here on each rank's engine); and
    # lora_sync: adapter over FSDP2 shards (formerly test_lora_sync_on_two_processes[adapter]): the base once,
    # then each rank's engine gets the adapter alone, the checks pass and the card says what is sent.
    # The run (_qlora_config) started with the module's first test (qlora_run); here it is awaited.
    tmp_path, run = qlora_run
    config = tmp_path / "config.yaml"
    output = run.output()
    assert "2 rank(s)" in output and "with NF4 base weights (QLoRA)" in output
    assert "Generation engine started, weights synced and checked" in output
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["generation/sync_logprob_diff"] < 1e-4, r  # the largest over both ranks' engines
        assert r["generation/logprob_mismatch"] < 1e-4, r  # over the model's tokens of every turn
        assert r["generation/sync_bytes"] == _adapter_bytes(config), r  # the adapter alone, not the base
    assert rows[1]["grad_norm"] > 0
    assert max(r["episode/turns"] for r in rows) > 1  # histories were continued through the adapter
    card = (tmp_path / "out" / "algorithm_card.md").read_text()
    assert "(lora_sync: adapter)" in card


class StaleAdapterGenerator(NativeGenerator):
    """Samples from its own copy of the LoRA policy (``holds_weights``, ``lora_sync: adapter``): the base and
    the first adapter reach it, later adapter versions are dropped (a skipped adapter sync).

    Args:
        model (dict): the run's model component (``${model}``).
        **kwargs: :class:`~torchtune_grpo.generation.NativeGenerator`'s.
    """

    holds_weights = True
    lora_sync = "adapter"

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self._copy = tt_config.instantiate(OmegaConf.create(model)).eval()
        self.versions = []

    def enable_lora(self, hparams):
        pass

    def load_weights(self, weights):
        self._copy.load_state_dict(dict(weights), strict=False)

    def load_adapter(self, adapter, hparams, *, version):
        self.versions.append(version)
        if version == 0:
            self._copy.load_state_dict(copy.deepcopy(adapter), strict=False)

    def prompt_logprobs(self, tokens):
        with torch.no_grad():
            return sequence_logprobs(self._copy, torch.tensor([tokens])).logprobs[0]

    @property
    def vocab_size(self):
        return self._copy.tok_embeddings.num_embeddings

    def generate(self, model, prompts, **kwargs):
        return super().generate(self._copy, prompts, **kwargs)


def test_a_stale_adapter_sync_stops_the_lora_run(tmp_path: Path, clean_env, one_thread, caplog):
    config = write_config(
        tmp_path, base=CONFIG, save_every_n_steps=None, **TRAIN,
        generation={"_component_": "tests.test_vllm_lora_recipe.StaleAdapterGenerator", "model": "${model}"},
    )
    with caplog.at_level(logging.INFO), pytest.raises(WeightSyncError) as error:
        run_in_process(config, lora=True)
    assert "Generation engine started, weights synced and checked" in caplog.text  # version 0 arrived
    message = str(error.value)
    assert message.startswith("Weight sync check failed after step 1"), message
    assert "stale" in message
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not _rows(tmp_path)
