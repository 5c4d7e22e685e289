"""benchmarks/moe_memory.py: the mixture-of-experts memory on paper counts what transformers builds, and the
shipped MoE configs' memory comments are its numbers.

Models are built on the meta device (shapes only, no memory), from the tiny families of tests/hf_moe.py and
from the published config.json files of tests/real_hf_configs.py.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import load_benchmark, REPO
from tests.hf_families import family_config
from tests.real_hf_configs import MOE_HUB_CONFIGS

mm = load_benchmark("moe_memory")

TEXT_FAMILIES = ("qwen3_moe", "qwen3_5_moe_text", "gpt_oss", "olmoe", "mixtral")
# The shipped MoE configs, the published model each names, and the GPU counts its memory comment is for.
CONFIGS = {"qwen3_moe/30B-A3B_full_grpo": ("Qwen3-30B-A3B", (8,)),
           "qwen3_moe/30B-A3B_lora_grpo": ("Qwen3-30B-A3B", (1, 2)),
           "gpt_oss/20B_lora_grpo": ("gpt-oss-20b", (1,)),
           "qwen3_5_moe/35B-A3B_lora_grpo": ("Qwen3.5-35B-A3B", (1, 2))}


def _meta_parameters(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied head is the embedding's tensor: counted once


@pytest.mark.parametrize("family", TEXT_FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_transformers_sum_of_numel(family: str, tied: bool):
    # Every family's tiny checkpoint config (its layer kinds: Gated DeltaNet and gated attention with a shared
    # expert, gpt-oss's biases and sinks, OLMoE's full-width q/k norms), with and without a tied head.
    config = family_config(family, tie_word_embeddings=tied)
    counts = mm.parameter_counts(mm.language_fields(config.to_dict()))
    assert counts["total"] == _meta_parameters(config)
    assert counts["head"] == (0 if tied else counts["embedding"])


@pytest.mark.parametrize("name", sorted(MOE_HUB_CONFIGS))
def test_published_models_are_counted_and_read_from_their_text_config(name: str, tmp_path: Path):
    # Through the file, as a user runs it (Qwen3.5-MoE's fields nested in text_config, gpt-oss's MXFP4
    # quantization_config beside them): the count equals transformers' module of the same fields.
    (tmp_path / "config.json").write_text(json.dumps(MOE_HUB_CONFIGS[name]))
    fields = mm.read_config(tmp_path)
    from transformers import AutoConfig

    config = AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "quantization_config"})
    assert mm.parameter_counts(fields)["total"] == _meta_parameters(config)


def test_qwen3_30b_a3b_by_hand():
    c = mm.language_fields(MOE_HUB_CONFIGS["Qwen3-30B-A3B"])
    p = mm.parameter_counts(c)
    # One layer: q 2048x4096 + k, v 2048x512 each + o 4096x2048 = 18,874,368; q/k norms 2 x 128; two norms
    # 2 x 2048; router 128 x 2048 = 262,144; 128 experts x 3 x 2048 x 768 = 603,979,776. Sum 623,120,640.
    assert p["largest_layer"] == 623_120_640
    # 48 layers + embedding and untied head 2 x 151,936 x 2048 + final norm 2048.
    assert p["total"] == 48 * 623_120_640 + 2 * 151_936 * 2048 + 2048 == 30_532_122_624
    # A token multiplies with 8 of the 128 experts: 120 x 4,718,592 fewer per layer.
    assert p["active"] == p["total"] - 48 * 120 * 3 * 2048 * 768
    # Kept per token per layer (bf16 units): norms 2 x (4 x 2048 + 2) = 16,388; attention 2 x (4096 + 512) + 2 x 32
    # = 9,280 and its q/k norms 3 x (4096 + 512) + 2 x (32 + 4) = 13,896; router 2 x 128 + 4 x 8 + 2 x 8 + 2 = 306;
    # dispatch 3 x 4 x 8 = 96; 8 expert copies x (2 x 2048 + 4 x 768 + 1) = 57,352.
    assert mm.layer_activation_elements(c, "full_attention", 1536) == 16_388 + 9_280 + 13_896 + 306 + 96 + 57_352


def _saved_bytes(config) -> int:
    """Bytes of the tensors autograd keeps for the backward in a bf16 forward of ``config``'s model (parameters
    excluded, each storage once), on 40 random tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 400, (1, 40)), use_cache=False)
    return sum(kept.values())


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_activation_estimate_is_what_autograd_keeps(family: str):
    # One softmax-attention decoder layer's share: 3 layers minus 1, halved (the embedding, head and the RoPE
    # tables, shared by the layers, cancel). Besides the per-token count, each layer keeps an int32 count per
    # expert (4 E bytes) and, in Qwen3.5, its norms' fp32 1 + weight (4 x (2 H + 2 head_dim) bytes). Integers:
    # equal exactly.
    layers = {n: dict(num_hidden_layers=n) for n in (1, 3)}
    if family in ("gpt_oss", "qwen3_5_moe_text"):  # their full-attention layers (gpt-oss's window is eager too)
        layers = {n: dict(num_hidden_layers=n, layer_types=["full_attention"] * n) for n in (1, 3)}
    config = family_config(family, **layers[3])
    per_layer = (_saved_bytes(config) - _saved_bytes(family_config(family, **layers[1]))) // 2
    c = mm.language_fields(config.to_dict())
    H, hd, E = config.hidden_size, config.head_dim, getattr(config, "num_experts", None) or config.num_local_experts
    constant = 4 * E + (4 * (2 * H + 2 * hd) if family == "qwen3_5_moe_text" else 0)
    assert per_layer == mm.layer_activation_elements(c, "full_attention", 40) * 40 * 2 + constant


def test_dense_layers_among_the_sparse_ones_are_refused_by_name():
    with pytest.raises(ValueError, match="mlp_only_layers = \\[0\\]"):
        mm.language_fields(dict(MOE_HUB_CONFIGS["Qwen3-30B-A3B"], mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="model_type 'qwen3' is not one of"):
        mm.language_fields({"model_type": "qwen3"})


@pytest.mark.parametrize("family,targets", [
    ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "output_proj"]),
    ("qwen3_5_moe_text", ["q_proj", "k_proj", "v_proj", "output_proj", "in_proj_qkv", "in_proj_z", "out_proj"]),
    ("gpt_oss", ["q_proj", "v_proj", "output_proj"]),
])
def test_lora_parameters_are_the_adapters_the_builder_adds(family: str, targets, tmp_path: Path):
    from torchtune_grpo.models import lora_hf_model

    family_config(family).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = lora_hf_model(str(tmp_path), lora_attn_modules=targets, lora_rank=4)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert mm.lora_parameters(mm.read_config(tmp_path), targets, 4) == adapters > 0


def _comment_peaks(text: str):
    """``{gpus: GB}`` from "about X GB per GPU on N GPU(s)" (and the same in parentheses) in a config's comment."""
    return {int(n): float(gb) for gb, n in re.findall(r"([\d.]+) GB per GPU on (\d+) GPU", text)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_memory_comment_is_the_scripts_table(name: str):
    hub, gpus = CONFIGS[name]
    path = REPO / "configs" / f"{name}.yaml"
    text = path.read_text()
    fields = mm.language_fields(MOE_HUB_CONFIGS[hub], hub)
    assert str(OmegaConf.load(path).checkpointer.checkpoint_dir) == f"/tmp/{hub}"
    assert f"{mm.parameter_counts(fields)['total']:,} language-model parameters" in text
    peaks = _comment_peaks(text)
    assert set(peaks) == set(gpus)
    for n in gpus:
        rows = mm.memory_rows(fields, mm.setup_from_recipe_config(path, n))
        assert rows[-1].phase == "peak" and round(rows[-1].per_gpu / mm.GB, 1) == peaks[n], (n, rows[-1])
        # Every row's number on the first GPU count is in the config's comment too (the comment's adapter memory
        # is the total, which tests/test_configs_families.py checks against the LoRA builder).
        for row in rows[:-1]:
            if n == gpus[0] and not row.name.startswith("adapters"):
                assert f"{row.per_gpu / mm.GB:.1f} GB" in text, row
    # The shipped MoE configs keep their shards in host memory: the comment says what a GPU would need otherwise.
    setup = mm.setup_from_recipe_config(path, gpus[0])
    assert setup.cpu_offload
    on_device = mm.memory_rows(fields, dataclasses.replace(setup, cpu_offload=False))[-1].per_gpu
    assert f"would need {on_device / mm.GB:.1f} GB" in text


def test_setup_reads_the_configs_batch_and_lora_keys():
    full = mm.setup_from_recipe_config(REPO / "configs/qwen3_moe/30B-A3B_full_grpo.yaml", 8)
    lora = mm.setup_from_recipe_config(REPO / "configs/qwen3_moe/30B-A3B_lora_grpo.yaml", 1)
    # batch_size 4 x group_size 8 rows; prompt 512 + response 1024; kl_coef 0 (full) holds no reference.
    assert (full.rows, full.micro_batch, full.seq_len, full.kl_reference, full.lora_rank) == (32, 4, 1536, False, None)
    assert (lora.lora_rank, list(lora.lora_targets)) == (32, ["q_proj", "k_proj", "v_proj", "output_proj"])
    names = [r.name for r in mm.memory_rows(mm.language_fields(MOE_HUB_CONFIGS["Qwen3-30B-A3B"]), full)]
    assert "fp32 master weights" in names and "bf16 frozen base weights" not in names
