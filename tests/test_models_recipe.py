"""The recipes with a model directory read by torchtune_grpo.models (a tiny random Qwen3 with its own
tokenizer and chat template): full fine-tuning, LoRA and QLoRA in process; every output directory loads in
transformers (and PEFT) with the logits of our own model. The vLLM engine with such a directory, through
`tune run`: tests/test_vllm_recipe.py::test_two_processes_one_engine_per_rank_running_multi_turn_episodes.
Two processes, for every architecture: tests/test_models_architectures.py."""

from pathlib import Path

import torch

from tests.hf_models import hf_components, hf_logits, make_model_dir
from tests.recipe_utils import read_jsonl, recipe_in_process, run_in_process, weights, write_config
from tests.conftest import REPO
from torchtune_grpo.models import HFCheckpointer, hf_model

TWO_STEPS = dict(max_steps=2, save_every_n_steps=2, lr_scheduler=None, **{"optimizer.lr": 1e-3})


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


def _our_logits(directory: Path, tmp_path: Path) -> torch.Tensor:
    model = hf_model(str(directory))
    model.load_state_dict(HFCheckpointer(str(directory), str(tmp_path / "scratch")).load_checkpoint()["model"])
    with torch.no_grad():
        return model.eval()(_tokens())


def check_trained_directory(src: Path, step_dir: Path, tmp_path: Path) -> None:
    """The step directory is a Hugging Face model: our model and transformers agree on it, the weights moved,
    and the source's config and tokenizer files came along."""
    start, end = weights(src), weights(step_dir)
    assert start.keys() == end.keys()
    assert max((end[k] - start[k]).abs().max().item() for k in start) > 1e-4
    # transformers against torchtune on the same weights (as tests/test_models.py): other op orders in ~15 matmuls, the
    # norms, attention and each library's RoPE tables (angles up to ~100 rad, 1 ulp 7.6e-6), on logits |z| <~ 4 (1 ulp
    # 4.8e-7): a few ulp, ~1e-5 relative at worst from the rope angles. Bound: 1e-4 (measured 1.6e-6 with AVX-512 and
    # AVX2 kernels) here and for the PEFT and NF4 comparisons below.
    torch.testing.assert_close(hf_logits(step_dir, _tokens()), _our_logits(step_dir, tmp_path), atol=1e-4, rtol=0)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (step_dir / name).read_bytes() == (src / name).read_bytes(), name


def _rows(tmp_path: Path):
    return [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]


def test_qwen3_full_one_process(tmp_path: Path, clean_env, one_thread):
    # In process (the recipe's setup/train/cleanup; `tune run` with a model directory:
    # tests/test_vllm_recipe.py::test_two_processes_one_engine_per_rank_running_multi_turn_episodes).
    src = make_model_dir(tmp_path / "Qwen3-tiny")
    config = write_config(tmp_path, **hf_components(src), **TWO_STEPS)
    run_in_process(config)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    check_trained_directory(src, tmp_path / "out" / "step_2", tmp_path)
    # Completions were rendered with the model's own chat template (Qwen3's, thinking on).
    prompt = read_jsonl(tmp_path / "out" / "completions.jsonl")[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_lora_adapter_and_merged_model_load_in_peft(tmp_path: Path, clean_env, one_thread):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    src = make_model_dir(tmp_path / "Qwen3-tiny")
    components = hf_components(src)
    components["model"] = {
        "_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
        "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
        "lora_rank": 4, "lora_alpha": 8,
    }
    base = REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml"
    config = write_config(tmp_path, base=base, **components, **TWO_STEPS)
    run_in_process(config, lora=True)  # grpo_lora_finetune_distributed, without the launcher
    step = tmp_path / "out" / "step_2"
    merged = step / "merged"
    # The merged model: a Hugging Face directory our model and transformers agree on, weights moved.
    check_trained_directory(src, merged, tmp_path)
    # The PEFT adapter on the base model gives the merged model's logits (q/k adapters in Qwen3's layout,
    # applied before the q/k norms as in the merge).
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), step).eval()
    with torch.no_grad():
        # PEFT (x W + s (x A) B, in transformers) against the merged model (x (W + s B A)): the same function in another
        # order, a few ulp of logits |z| <~ 4 (1 ulp 4.8e-7). Bound: 1e-4.
        torch.testing.assert_close(peft(_tokens()).logits, hf_logits(merged, _tokens()), atol=1e-4, rtol=0)
        assert (peft(_tokens()).logits - hf_logits(src, _tokens())).abs().max() > 1e-4  # the adapter is not zero


def test_qwen3_qlora_in_process_adapter_and_merged_model_load(tmp_path: Path, clean_env, one_thread):
    # QLoRA through the LoRA recipe (in process) with the directory builder on a tiny Qwen3 whose sizes NF4
    # can quantise: every adapted weight a multiple of 64 x 256 values (q/k/v/o 128 x 128, MLP 128 x 256,
    # output 512 x 128). The reference is our trained model, NF4 base weights and all.
    from omegaconf import OmegaConf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from torchtune_grpo.models.lora import nf4_parameters
    from torchtune_grpo.models import tune_to_hf_param

    src = make_model_dir(tmp_path / "Qwen3-tiny", hidden_size=128, intermediate_size=256, num_key_value_heads=4,
                         head_dim=32)
    components = hf_components(src)
    components["model"] = {
        "_component_": "torchtune_grpo.models.lora_hf_model", "path": "${checkpointer.checkpoint_dir}",
        "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
        "apply_lora_to_output": True, "lora_rank": 4, "lora_alpha": 8, "quantize_base": True,
    }
    config = write_config(tmp_path, base=REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml", **components,
                          max_steps=2, save_every_n_steps=2, lr_scheduler=None, batch_size=2, max_response_length=8)
    cfg = OmegaConf.load(config)
    with recipe_in_process(cfg, lora=True) as recipe:
        recipe.train()
        with torch.no_grad():
            ours = recipe.model.eval()(_tokens())  # NF4 base (dequantised per matmul) + adapters
        nf4 = {name: w.get_original_weight() for name, w in nf4_parameters(recipe.model)}
    assert len(nf4) == 2 * 7 + 1  # q, k, v, o, w1, w2, w3 in each of 2 layers, and the output projection
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    step = tmp_path / "out" / "step_2"
    adapter = torch.load(step / "adapter_model.pt", weights_only=True)
    lora_b = [v for k, v in adapter.items() if k.endswith("lora_b.weight")]
    assert len(lora_b) == len(nf4) and all(v.abs().max() > 0 for v in lora_b)  # every B started at zero

    # Tolerance 1e-4 on fp32 logits (as every logits comparison here): both sides compute the same function,
    # dequantised NF4 base + scale * B @ A, so they differ only by fp32 rounding (measured ~6e-6 for the merged
    # model, 0 for PEFT). NF4's own error is far larger (base weights move by up to ~0.05, the logits of the
    # adapter on the original base by ~2), which is why the reference is the NF4 model, not the source weights.
    torch.testing.assert_close(hf_logits(step / "merged", _tokens()), ours, atol=1e-4, rtol=0)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (step / "merged" / name).read_bytes() == (src / name).read_bytes(), name
    # The PEFT adapter on the base model the trainer saw: transformers' model with the dequantised NF4
    # weights in place of the adapted layers' base weights (each one a PEFT LoRA layer: targets mapped).
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), step).eval()
    quantisation_error = 0.0
    with torch.no_grad():
        for name, weight in nf4.items():
            hf_name, hf_weight = tune_to_hf_param(name, weight, rope_order="half", head_dim=32)
            layer = peft.get_base_model().get_submodule(hf_name[: -len(".weight")])
            quantisation_error = max(quantisation_error, (layer.base_layer.weight - hf_weight).abs().max().item())
            layer.base_layer.weight.copy_(hf_weight)
        # PEFT on the dequantised NF4 base against our QLoRA model: the same function in another order (as above), a few
        # ulp of the logits plus the RoPE tables' <~ 1e-5. Bound: 1e-4.
        torch.testing.assert_close(peft(_tokens()).logits, ours, atol=1e-4, rtol=0)
    assert quantisation_error > 1e-3  # the base really was quantised (so the check above is not the plain one)


def test_eval_command_with_a_model_directory(tmp_path: Path, one_thread):
    # `tune-grpo eval` (in process) on a step directory written by HFCheckpointer: the directory components
    # serve the CLI's own checkpointer/model/tokenizer wiring, and the prompts use the model's chat template.
    import json

    from omegaconf import OmegaConf
    from torchtune_grpo.cli import main as cli_main

    src = make_model_dir(tmp_path / "Qwen3-tiny")
    step = HFCheckpointer(str(src), str(tmp_path / "out")).save_checkpoint(
        {"model": HFCheckpointer(str(src), str(tmp_path / "o2")).load_checkpoint()["model"]}, epoch=1
    )
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "demo_grpo.yaml")
    cfg.output_dir = str(tmp_path / "run")
    for key, value in hf_components(src).items():
        OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    cfg.validation.prompt_style = "chat"
    cfg.validation.system_prompt = "Answer."
    cfg.validation.num_samples, cfg.eval_num_samples, cfg.max_response_length = 4, 2, 6
    OmegaConf.save(cfg, tmp_path / "eval.yaml")
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--config", str(tmp_path / "eval.yaml"), f"checkpoint_dir={step}", f"json={out}"]) == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 4 and len(result["samples"]) == 4
    assert result["samples"][0]["prompt"].startswith("<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\n")
