"""The LoRA/QLoRA recipe: `tune run grpo_lora_finetune_distributed --config ...`, plus its pieces in process.

In process (tests.recipe_utils.run_in_process): metrics, the adapter in PEFT format, the merged Hugging Face
model and resumption, for LoRA and QLoRA; through `tune run`: 2 processes. Also in process: the reference
logprobs are the base model's, only adapter parameters get gradients, base weights never move, and the
PEFT export (torchtune_grpo.models.lora) gives PEFT the same model as torchtune's, for Qwen2 and Llama layouts.
"""

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Dict

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune import config as tt_config, training
from torchtune.modules.peft import get_adapter_params

from tests.conftest import REPO
from tests.recipe_utils import (
    REQUIRED_METRICS, read_jsonl, recipe_in_process, run_in_process, run_tune, weights, write_config,
)
from torchtune_grpo.assets import asset_path
from torchtune_grpo.models.lora import (
    load_nf4_base_weights,
    lora_hyperparams,
    peft_adapter_weights,
    read_hf_config,
    save_adapter,
)
from torchtune_grpo.models.logprobs import sequence_logprobs

LORA_CONFIG = REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml"
RECIPE = "grpo_lora_finetune_distributed"
ASSET = Path(asset_path("tiny_qwen2"))
PEFT_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def run_lora(config_path: Path, *overrides: str, nproc: int = 1, cwd: Path) -> str:
    return run_tune(config_path, *overrides, nproc=nproc, cwd=cwd, recipe=RECIPE)


def tune_state(directory: Path, scratch: Path) -> Dict[str, torch.Tensor]:
    """A Hugging Face Qwen2 directory's weights under torchtune names (torchtune's own HF checkpointer)."""
    files = sorted(p.name for p in directory.glob("*.safetensors") if not p.name.startswith("adapter"))
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=str(directory), checkpoint_files=files, model_type="QWEN2", output_dir=str(scratch)
    )
    return ckpt.load_checkpoint()[training.MODEL_KEY]


def tiny_lora_model(adapter: Dict[str, torch.Tensor], scratch: Path, quantize_base: bool = False):
    """The tiny LoRA (or QLoRA) model of the shipped config: the asset's base weights plus ``adapter``."""
    cfg = OmegaConf.load(LORA_CONFIG)
    cfg.model.quantize_base = quantize_base
    model = tt_config.instantiate(cfg.model)
    base = tune_state(ASSET, scratch)
    nf4 = set()
    if quantize_base:
        nf4 = set(load_nf4_base_weights(model, base, torch.device("cpu"), torch.float32))
    missing, unexpected = model.load_state_dict({**base, **adapter}, strict=False)
    assert not unexpected and set(missing) <= nf4, (unexpected, missing)
    return model.eval()


def adapter_delta(adapter: Dict[str, torch.Tensor], key: str, scale: float) -> torch.Tensor:
    """``scale x B @ A`` of the LoRA layer whose base weight is ``key`` (``...q_proj.weight``)."""
    prefix = key[: -len(".weight")]
    return scale * adapter[f"{prefix}.lora_b.weight"] @ adapter[f"{prefix}.lora_a.weight"]


def _crash_after_step_2(out: Path, final: str) -> None:
    """What a crash right after the step-2 checkpoint leaves: ``final`` and metrics rows 3+ gone."""
    shutil.rmtree(out / final)
    rows = read_jsonl(out / "metrics.jsonl")[:2]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))


def _resume_in_process(cfg: Path, caplog, **overrides) -> None:
    """The run of ``cfg`` again with ``resume_from_checkpoint=True`` (and ``overrides``), in this process."""
    resume = OmegaConf.load(cfg)
    resume.resume_from_checkpoint = True
    for key, value in overrides.items():
        OmegaConf.update(resume, key, value, force_add=True, merge=False)
    path = cfg.parent / "resume.yaml"
    OmegaConf.save(resume, path)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run_in_process(path, lora=True)
    assert "Resuming from" in caplog.text and "step_2" in caplog.text


def test_lora_run_outputs_load_agree_and_resume(tmp_path, caplog, clean_env, one_thread):
    # In process (test_two_processes runs this recipe through `tune run`). seed: null draws a random seed; the
    # resumed run must take the checkpoint's.
    cfg = write_config(tmp_path, base=LORA_CONFIG, max_steps=3, save_every_n_steps=2, seed=None)
    with caplog.at_level(logging.INFO):
        run_in_process(cfg, lora=True)
    assert "Reference model: the base model: the policy with its adapters disabled" in caplog.text
    out = tmp_path / "out"
    assert "policy with its adapters disabled (no second copy)" in (out / "algorithm_card.md").read_text()

    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert REQUIRED_METRICS <= m.keys(), REQUIRED_METRICS - m.keys()
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    assert any(m["grad_norm"] > 0 for m in metrics)
    # The reference is the base model = the initial policy (B = 0): KL 0 at first, then positive.
    assert metrics[0]["kl"] < 1e-6 and metrics[-1]["kl"] > 0

    final = out / "step_3"
    assert (out / "step_2" / "recipe_state.pt").is_file() and (final / "recipe_state.pt").is_file()
    assert not list(out.glob(".step_*")) and not list(out.glob("epoch_*"))  # staging dirs are gone
    peft_config = json.loads((final / "adapter_config.json").read_text())
    assert peft_config["peft_type"] == "LORA" and peft_config["r"] == 8 and peft_config["lora_alpha"] == 16
    assert set(peft_config["target_modules"]) == PEFT_TARGETS
    scale = peft_config["lora_alpha"] / peft_config["r"]

    # The adapter trained: every B started at zero.
    adapter = torch.load(final / "adapter_model.pt", weights_only=True)
    lora_b = [v for k, v in adapter.items() if k.endswith("lora_b.weight")]
    assert len(lora_b) == 2 * 7 and all(v.abs().max() > 0 for v in lora_b)

    # Base weights unchanged: the merged model is exactly the original base plus the adapter's update.
    base = tune_state(ASSET, tmp_path / "scratch")
    merged = tune_state(final / "merged", tmp_path / "scratch")
    assert merged.keys() == base.keys()
    for key, value in base.items():
        lora = key.endswith(".weight") and f"{key[:-len('.weight')]}.lora_a.weight" in adapter
        expected = value + adapter_delta(adapter, key, scale) if lora else value
        # W + s B A in fp32 both ways: a rank-8 product (8 roundings at |s B A| << |W|, the adapters are a few steps
        # old) in another order, then one rounding of the sum at |W| <= 0.093 (ulp 7.5e-9): ~1e-8 apart at most; other
        # keys are copies (0). Bound: 1e-6 (> 100 ulp of the largest weight), kernel-independent.
        torch.testing.assert_close(merged[key], expected, atol=1e-6, rtol=0, msg=key)

    # PEFT on the base, transformers on the merged model and torchtune's LoRA model: same logits.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(final / "merged").encode("What is 3 + 4? <answer>7")])
    with torch.no_grad():
        hf_merged = AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()(ids)
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32), final
        ).eval()
        peft_logits = peft_model(ids).logits
        tt_logits = tiny_lora_model(adapter, tmp_path / "scratch")(ids)
    # PEFT (adapters on transformers' layers), the merged model in transformers and torchtune's LoRA model compute the
    # same fp32 function in another order: x W + s (x A) B against x (W + s B A), ~15 matmuls, norms, attention and each
    # library's RoPE tables, on the tiny asset's logits |z| <~ 2 (1 ulp 2.4e-7): a few ulp, <~ 1e-5 from the rope
    # angles. Bound: 1e-4 + 1e-4 relative.
    torch.testing.assert_close(peft_logits, tt_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hf_merged.logits, tt_logits, atol=1e-4, rtol=1e-4)

    # Resume from step 2 without its merged model (as save_adapter_weights_only writes it): resuming needs the
    # adapter, the optimizer and the rest, never the merged model (base weights come from
    # checkpointer.checkpoint_dir again). The resumed run writes adapter-only checkpoints.
    uninterrupted_peft = weights(final)
    _crash_after_step_2(out, "step_3")
    shutil.rmtree(out / "step_2" / "merged")
    _resume_in_process(cfg, caplog, save_adapter_weights_only=True)
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert not (final / "merged").exists()
    resumed = torch.load(final / "adapter_model.pt", weights_only=True)
    assert resumed.keys() == adapter.keys()
    # A resumed run is the uninterrupted computation itself: weights, optimizer and LR state, RNG streams and
    # data order restored bit for bit, the same kernels on the same shapes. So it compares a computation with
    # itself: exact (formerly 1e-6 + 1e-5 relative; measured bitwise equal with AVX-512, AVX2 and scalar kernels).
    for key in adapter:
        torch.testing.assert_close(resumed[key], adapter[key], atol=0, rtol=0)
    resumed_peft = weights(final)
    assert resumed_peft.keys() == uninterrupted_peft.keys()
    # As above: exact.
    for key in uninterrupted_peft:
        torch.testing.assert_close(resumed_peft[key], uninterrupted_peft[key], atol=0, rtol=0)


def test_qlora_runs_merged_model_matches_and_resumes(tmp_path, caplog, clean_env, one_thread):
    # In process; QLoRA on two processes: tests/test_models_architectures.py (lora_hf_model, quantize_base).
    cfg = write_config(
        tmp_path, base=LORA_CONFIG, max_steps=3, save_every_n_steps=2, seed=None, **{"model.quantize_base": True}
    )
    with caplog.at_level(logging.INFO):
        run_in_process(cfg, lora=True)
    assert "with NF4 base weights (QLoRA)" in caplog.text
    out = tmp_path / "out"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    final = out / "step_3"
    adapter = torch.load(final / "adapter_model.pt", weights_only=True)
    # The merged model is the trained model: dequantized NF4 base + adapter.
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12]])
    with torch.no_grad():
        hf_merged = AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
        qlora = tiny_lora_model(adapter, tmp_path / "scratch", quantize_base=True)
        # The merged file holds dequantised NF4 + s B A; the QLoRA model dequantises the same NF4 on the fly and adds s
        # (x A) B: the same function in another order (as above), a few ulp at |z| <~ 2 plus the rope tables' <~ 1e-5.
        # Bound: 1e-4 + 1e-4 relative.
        torch.testing.assert_close(hf_merged(ids).logits, qlora(ids), atol=1e-4, rtol=1e-4)

    # Resume from step 2: base weights from checkpointer.checkpoint_dir again, re-quantized.
    uninterrupted_peft = weights(final)
    _crash_after_step_2(out, "step_3")
    _resume_in_process(cfg, caplog)
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert (final / "merged").is_dir()
    resumed = torch.load(final / "adapter_model.pt", weights_only=True)
    assert resumed.keys() == adapter.keys()
    # A resumed run is the uninterrupted computation itself: weights, optimizer and LR state, RNG streams and
    # data order restored bit for bit, the same kernels on the same shapes. So it compares a computation with
    # itself: exact (formerly 1e-6 + 1e-5 relative; measured bitwise equal with AVX-512, AVX2 and scalar kernels).
    for key in adapter:
        torch.testing.assert_close(resumed[key], adapter[key], atol=0, rtol=0)
    resumed_peft = weights(final)
    # As above: exact.
    for key in uninterrupted_peft:
        torch.testing.assert_close(resumed_peft[key], uninterrupted_peft[key], atol=0, rtol=0)


@pytest.mark.slow
def test_two_processes(tmp_path):
    # This recipe through `tune run` (the other tests here run it in process). As in tests/test_recipe.py: the
    # recipe leaves with os._exit(0) after a torchrun launch; the exit code is judged as is. Without KL: no
    # reference forward at all. (QLoRA on two processes, with KL: tests/test_models_architectures.py.)
    cfg = write_config(tmp_path, base=LORA_CONFIG, max_steps=2, batch_size=2, kl_coef=0.0)
    log = run_lora(cfg, nproc=2, cwd=tmp_path)
    assert "2 rank(s)" in log
    assert "Reference model: none (kl_coef = 0)" in log
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(REQUIRED_METRICS <= m.keys() and math.isfinite(m["loss"]) for m in metrics)
    assert all(m["kl"] == 0.0 for m in metrics)
    final = tmp_path / "out" / "step_2"
    adapter = torch.load(final / "adapter_model.pt", weights_only=True)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if k.endswith("lora_b.weight"))
    assert (final / "adapter_model.safetensors").is_file() and (final / "merged" / "config.json").is_file()


# ------------------------------------------------------------------------------------------ in process


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one intra-op thread (tests/conftest.py)."""


def _dense(param: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain full tensor: gathered if sharded (DTensor), dequantized if NF4."""
    t = param.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, NF4Tensor):
        t = t.get_original_weight()
    return t.clone()


@pytest.mark.parametrize("quantize_base", [False, True], ids=["lora", "qlora"])
def test_reference_is_base_model_and_only_adapters_train(tmp_path, clean_env, quantize_base):
    # No LR warmup, so the first optimizer step already moves the adapters.
    path = write_config(
        tmp_path, base=LORA_CONFIG, max_steps=1, lr_scheduler=None, **{"model.quantize_base": quantize_base}
    )
    with recipe_in_process(path, lora=True) as recipe:
        model = recipe.model
        adapter_names = set(get_adapter_params(model))
        assert adapter_names and all("lora_a" in n or "lora_b" in n for n in adapter_names)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == adapter_names
        base_before = {n: _dense(p) for n, p in model.named_parameters() if n not in adapter_names}
        adapters_before = {n: _dense(p) for n, p in model.named_parameters() if n in adapter_names}
        if not quantize_base:  # the base weights are the checkpoint's
            asset = tune_state(ASSET, tmp_path / "scratch")
            assert base_before.keys() == asset.keys()
            assert all(torch.equal(base_before[k], asset[k]) for k in asset)

        metrics = recipe.train_step().metrics
        assert metrics["grad_norm"] > 0
        after = {n: _dense(p) for n, p in model.named_parameters()}
        # Base weights did not move; the adapters did (every B was zero).
        assert all(torch.equal(after[n], base_before[n]) for n in base_before)
        assert all(after[n].abs().max() > 0 for n in adapters_before if "lora_b" in n)

        # Only adapter parameters receive gradients.
        tokens = torch.randint(0, 480, (4, 16), generator=torch.Generator().manual_seed(0))
        model.train()
        sequence_logprobs(model, tokens).logprobs.sum().backward()
        assert {n for n, p in model.named_parameters() if p.grad is not None} == adapter_names
        recipe.optimizer.zero_grad(set_to_none=True)

        # Reference logprobs (adapters disabled) are the base model's; the adapters are back on afterwards.
        model.eval()
        policy = recipe.step.build_experience.logprobs(model, tokens)
        reference = recipe.step.build_experience.reference_logprobs(tokens)
        base_model = tt_config.instantiate(OmegaConf.load(REPO / "configs" / "tiny" / "full_grpo_cpu.yaml").model)
        base_model.load_state_dict(base_before)  # strict: exactly the base model's weights (dequantized NF4)
        with torch.no_grad():
            expected = sequence_logprobs(base_model.eval(), tokens).logprobs
        # The recipe's reference forward runs the padded batch, the expected one the same tokens through the base model
        # (dequantised NF4 weights loaded as plain fp32): other matmul shapes and the NF4 layer's dequantise-then-matmul
        # in another order. A logprob is a logit minus a logsumexp at the tiny asset's |z| <~ 2 (1 ulp 2.4e-7): a few
        # ulp each, ~1e-6. Bound: 1e-5 + 1e-5 relative (> 40 ulp).
        torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
        assert (policy - reference).abs().max() > 1e-4
        # Exact: the same call on the same model and tokens.
        torch.testing.assert_close(recipe.step.build_experience.logprobs(model, tokens), policy, atol=0, rtol=0)

        # The reference is the policy itself, with its adapters switched off: no second copy of the weights.
        assert recipe.step.build_experience.reference.model is model


def test_an_engine_with_its_own_weights_is_accepted(tmp_path, clean_env):
    # It used to be refused ("LoRA + vLLM"); the publisher now sends it the base once and then the adapter
    # (tests/test_vllm_lora_recipe.py runs it). Constructing the recipe starts no engine, but it does
    # create the one-process group (clean_env destroys it, so later in-process runs can make theirs).
    from grpo_lora_finetune_distributed import GRPOLoRAFinetuneRecipeDistributed

    cfg = OmegaConf.load(write_config(tmp_path, base=LORA_CONFIG, max_steps=1))
    cfg.generation = {"_component_": "torchtune_grpo.generation.VLLMGenerator", "model": "unused"}
    recipe = GRPOLoRAFinetuneRecipeDistributed(cfg)
    assert recipe.engine.holds_weights and recipe.engine.lora_sync == "adapter"


def test_non_lora_model_is_refused():
    with torch.device("meta"):
        model = tt_config.instantiate(OmegaConf.load(REPO / "configs" / "tiny" / "full_grpo_cpu.yaml").model)
    with pytest.raises(ValueError, match="no LoRA layers"):
        lora_hyperparams(model)


# --------------------------------------------------------------------------------------- PEFT export


def _randomize_adapters(model: torch.nn.Module, seed: int = 0) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_peft_export_qwen2(tmp_path):
    # torchtune 0.6.1's own export permutes Qwen2's q/k lora_B rows as if they had Llama's RoPE layout;
    # ours does not, and PEFT then computes exactly torchtune's model.
    from peft import PeftModel
    from torchtune.models import convert_weights
    from transformers import AutoModelForCausalLM

    cfg = OmegaConf.load(LORA_CONFIG)
    model = tt_config.instantiate(cfg.model)
    model.load_state_dict(tune_state(ASSET, tmp_path / "scratch"), strict=False)
    adapter = _randomize_adapters(model)
    hf_config = read_hf_config(str(ASSET))
    save_adapter(tmp_path / "adapter", adapter, lora_hyperparams(model), model_type="QWEN2",
                 hf_config=hf_config)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        # PEFT on transformers against torchtune's LoRA model: x W + s (x A) B in both, other op orders in ~15 matmuls,
        # the norms and attention, and each library's RoPE tables over 10 positions (angles <= 10 rad, 1 ulp 9.5e-7), on
        # logits |z| <~ 2 (1 ulp 2.4e-7): a few ulp, ~1e-6. Bound: 1e-5 + 1e-5 relative (> 40 ulp).
        torch.testing.assert_close(peft_logits, model.eval()(ids), atol=1e-5, rtol=1e-5)

    ours = peft_adapter_weights(adapter, model_type="QWEN2", num_heads=4, num_kv_heads=4, dim=128)
    torchtune_s = convert_weights.tune_to_peft_adapter_weights(adapter, num_heads=4, num_kv_heads=4, dim=128)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert not torch.equal(ours[key], torchtune_s[key])
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    assert torch.equal(ours[key], torchtune_s[key])


def test_peft_export_llama(tmp_path):
    # Llama checkpoints are permuted into torchtune's RoPE layout on load, so the adapter's q/k rows are
    # permuted back on export (torchtune's mapping, kept as is). Output projection adapted too (lm_head).
    from peft import PeftModel
    from torchtune.models.llama3 import lora_llama3
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        dtype=torch.float32,
    )
    hf.save_pretrained(tmp_path / "base")
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "base"), checkpoint_files=["model.safetensors"], model_type="LLAMA3",
        output_dir=str(tmp_path / "scratch"),
    )
    model = lora_llama3(
        ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, apply_lora_to_output=True,
        vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=256,
        intermediate_dim=128, norm_eps=1e-5, rope_base=500000.0, lora_rank=4, lora_alpha=8,
    )
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY], strict=False)
    adapter = _randomize_adapters(model, seed=1)
    hparams = lora_hyperparams(model)
    assert "output" in hparams.target_modules
    save_adapter(tmp_path / "adapter", adapter, hparams, model_type="LLAMA3",
                 hf_config=read_hf_config(str(tmp_path / "base")))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        # As above, for the Llama model: a few ulp of logits |z| <~ 2, ~1e-6. Bound: 1e-5 + 1e-5 relative.
        torch.testing.assert_close(peft_logits, model.eval()(ids), atol=1e-5, rtol=1e-5)
