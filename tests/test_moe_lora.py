"""LoRA on mixture-of-experts families (transformers' module): attention adapters that PEFT loads and merges as we
do, QLoRA's NF4 on the adapted attention layers with the experts and routers unquantised, and the targets that are
refused by name (the fused experts, the router)."""

import pytest
import torch

from tests.hf_families import make_family_dir
from tests.hf_models import hf_components
from tests.hf_moe import MOE_FAMILY_NAMES
from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config
from tests.test_transformers_backend import _check_step_directory, _hf, LORA_CONFIG
from tests.tolerances import ulps

TWO_STEPS = dict(max_steps=2, save_every_n_steps=2, lr_scheduler=None, **{"optimizer.lr": 1e-3})
ATTENTION = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _lora(src, **model):
    components = hf_components(src)
    components["model"] = {"_component_": "torchtune_grpo.models.lora_hf_model", "lora_rank": 4, "lora_alpha": 8,
                           "path": "${checkpointer.checkpoint_dir}", **model}
    return components


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_attention_lora_loads_in_peft_and_equals_the_merged_model(family, tmp_path, clean_env, one_thread):
    from peft import PeftModel

    src = make_family_dir(family, tmp_path / "model")
    log = []
    run_in_process(write_config(tmp_path, base=LORA_CONFIG, **_lora(src, lora_attn_modules=ATTENTION), **TWO_STEPS),
                   lora=True, log=log)
    assert any("fused experts and the routers stay frozen" in line for line in log)
    step = tmp_path / "out" / "step_2"
    _check_step_directory(src, step / "merged", tmp_path)  # transformers loads it, with our logits
    merged_by_peft = PeftModel.from_pretrained(_hf(src), step).merge_and_unload().state_dict()
    ours, base = weights(step / "merged"), weights(src)
    assert ours.keys() == base.keys()  # the on-disk layout: per-expert tensors, towers, mtp.*
    changed = 0
    for key, value in ours.items():
        name = key.replace("language_model.", "", 1)  # Qwen3.5-MoE on disk -> PEFT's text-only model
        if "experts" in key or ".gate." in key or ".router." in key or name not in merged_by_peft:
            assert torch.equal(value, base[key]), key  # experts, routers, towers: frozen, written back as loaded
            continue
        # As for the dense families: W + (alpha / r) B A, a rank-4 product, the scale and the sum: <= 6 ulp of the
        # tensor's largest value in any order. Bound: 8 ulp.
        torch.testing.assert_close(merged_by_peft[name], value, atol=ulps(value, 8), rtol=0, msg=key)
        changed += not torch.equal(value, base[key])
    assert changed >= 4  # q, k, v, o of at least one layer trained (B started at zero)


def test_qlora_quantises_attention_only(tmp_path, clean_env, one_thread):
    # NF4 on the adapted q/o projections (128 x 128: whole NF4 blocks); the experts and the router are frozen in their
    # fp32 and come back bit for bit in the merged model.
    src = make_family_dir("qwen3_moe", tmp_path / "model")
    log = []
    run_in_process(write_config(tmp_path, base=LORA_CONFIG, **TWO_STEPS, **_lora(
        src, lora_attn_modules=["q_proj", "output_proj"], quantize_base=True)), lora=True, log=log)
    line = next(line for line in log if "with NF4 base weights (QLoRA)" in line)
    assert "'q_proj'" in line and "'o_proj'" in line and "experts" not in line
    assert any("stay frozen, unquantised (NF4 on the adapted layers only)" in line for line in log)
    assert [r["step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r] == [1, 2]
    merged, base = weights(tmp_path / "out" / "step_2" / "merged"), weights(src)
    for key in (k for k in base if "experts" in k or ".gate." in k):
        assert torch.equal(merged[key], base[key]), key


@pytest.mark.parametrize("targets, mlp, names", [
    (ATTENTION, True, ["'w1'", "fused 3-D parameters", "experts.gate_up_proj", "(4, 128, 128)", "apply_lora_to_mlp"]),
    (["q_proj", "gate_proj"], False, ["'gate_proj'", "fused 3-D parameters"]),
    (["q_proj", "gate"], False, ["'gate'", "router", "frozen and unquantised"]),
])
def test_expert_and_router_targets_are_refused_by_name(targets, mlp, names, tmp_path):
    from torchtune_grpo.models import lora_hf_model

    src = make_family_dir("qwen3_moe", tmp_path / "model")
    with pytest.raises(ValueError) as err, torch.device("meta"):
        lora_hf_model(str(src), lora_attn_modules=targets, apply_lora_to_mlp=mlp)
    assert all(n in str(err.value) for n in names), str(err.value)
