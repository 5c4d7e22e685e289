"""Mixture-of-experts families as transformers' own module (tiny directories of tests/hf_moe.py: peaked attention,
decisive routers, 4 experts, top-2):

- per-token logprobs through the recipe's chunked head equal transformers' own, from the on-disk layout (per-expert
  tensors gathered into the fused 3-D parameters; gpt-oss fused; Qwen3.5-MoE's language model out of a multimodal
  directory);
- two GRPO steps through the recipe (native engine: transformers' generate) move the experts and routers, and the
  step directory, written in the on-disk layout, loads in transformers with our model's logits;
- resume equals the uninterrupted run;
- gpt-oss's MXFP4 experts are dequantised exactly on load and saved unquantised.

Two processes (FSDP2, experts sharded with their decoder layer): tests/test_models_architectures.py's shared launch.
LoRA: tests/test_moe_lora.py.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.hf_families import make_family_dir
from tests.hf_models import hf_components
from tests.hf_moe import MOE_FAMILY_NAMES
from tests.recipe_utils import read_jsonl, run_in_process, weights, write_config
from tests.test_transformers_backend import _hf, _policy, _tokens, assert_logprobs_equal_transformers
from torchtune_grpo.models import HFCheckpointer

TWO_STEPS = dict(max_steps=2, save_every_n_steps=2, lr_scheduler=None, **{"optimizer.lr": 1e-3})


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    made = {}

    def get(family: str) -> Path:
        if family not in made:  # Qwen3.5-MoE sharded with an index, as the real checkpoints are
            shards = {"max_shard_size": "200KB"} if family == "qwen3_5_moe" else {}
            made[family] = make_family_dir(family, tmp_path_factory.mktemp(family), **shards)
        return made[family]

    return get


def _names(directory: Path) -> set:
    out = set()
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), "pt") as g:
            out.update(g.keys())
    return out


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_logprobs_equal_transformers_own(family, moe_dir, tmp_path):
    directory = moe_dir(family)
    policy = _policy(directory, tmp_path)
    experts = [n for n, p in policy.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert experts and all(policy.get_parameter(n).dim() == 3 for n in experts)  # fused [E, ., .] parameters
    # As for the dense families: the same transformers code on the same weights (routing included: the routers'
    # top-k gaps are >= 3e-3, rounding moves a logit by ~1e-6), only the chunked logsumexp head differs. Bound: 1e-5.
    assert_logprobs_equal_transformers(policy, directory)


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_two_grpo_steps_and_the_step_directory_in_the_on_disk_layout(family, moe_dir, tmp_path, clean_env,
                                                                     one_thread):
    src = moe_dir(family)
    run_in_process(write_config(tmp_path, **hf_components(src), **TWO_STEPS))
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    step = tmp_path / "out" / "step_2"
    start, end = weights(src), weights(step)
    assert start.keys() == end.keys()  # the same on-disk names: per-expert, fused, towers, mtp.*
    for kind in ("experts.", ".gate.weight" if family != "gpt_oss" else ".router.weight"):
        assert max((end[k] - start[k]).abs().max().item() for k in start if kind in k) > 1e-4, kind
    for key in (k for k in start if "visual" in k or k.startswith("mtp.")):
        assert torch.equal(start[key], end[key]), key  # carried byte for byte
    index = "model.safetensors.index.json"
    if (src / index).is_file():  # every tensor (each expert's too) in the shard the source had it in
        weight_map = [json.loads((d / index).read_text())["weight_map"] for d in (src, step)]
        assert weight_map[0] == weight_map[1] and len(set(weight_map[0].values())) > 1
    tokens = _tokens((24,))
    with torch.no_grad():
        ours = _policy(step, tmp_path)(tokens)
        theirs = _hf(step)(tokens).logits
    # The same transformers modules on the same weights, our [B*L] head against theirs. Bound 1e-5 (as dense).
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert (step / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_fsdp2_shards_the_experts_with_their_decoder_layer(moe_dir, clean_env):
    # Each decoder layer is one FSDP2 unit (torchtune's per-layer condition matches transformers' model.layers.N), and
    # the fused experts and the router are in it, sharded along the expert dimension: unsharding the layer alone
    # (FSDPModule.unshard) gathers them, while the root's embedding stays sharded.
    import dataclasses

    from omegaconf import OmegaConf
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from tests.recipe_utils import init_one_process_group
    from tests.test_transformers_backend import FP32
    from torchtune_grpo.runtime.model_setup import build_model

    init_one_process_group()
    src = moe_dir("qwen3_moe")
    state = HFCheckpointer(str(src), str(src.parent / "scratch")).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(src)})
    policy = build_model(cfg, state, dataclasses.replace(FP32, single_process_fsdp=True), trainable=True,
                         source=str(src), max_len=64)
    layer = policy.layers[0]
    moe = [layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight]
    assert isinstance(layer, FSDPModule) and all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in moe)
    layer.unshard()
    try:
        moe = [layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight]
        assert not any(isinstance(p, DTensor) for p in moe)
        assert tuple(moe[0].shape) == (4, 128, 128)  # all 4 experts, [E, 2I, H]
        assert isinstance(policy.tok_embeddings.weight, DTensor)  # the root's unit: not gathered by the layer's
    finally:
        layer.reshard()


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_resume_equals_the_uninterrupted_run(family, moe_dir, tmp_path, clean_env, one_thread):
    # 3 steps straight against 2 steps, then a resumed run to step 3 (the directory written at step 2, per-expert or
    # fused as the family stores it, read back into the fused parameters). Exact: the same operations on the same
    # numbers.
    src = moe_dir(family)
    settings = dict(**hf_components(src), lr_scheduler=None, **{"optimizer.lr": 1e-3})
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    run_in_process(write_config(tmp_path / "a", **settings, max_steps=3, save_every_n_steps=3))
    run_in_process(write_config(tmp_path / "b", **settings, max_steps=2, save_every_n_steps=2))
    run_in_process(write_config(tmp_path / "b", **settings, max_steps=3, save_every_n_steps=3,
                                resume_from_checkpoint=True))
    a, b = weights(tmp_path / "a" / "out" / "step_3"), weights(tmp_path / "b" / "out" / "step_3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[r["loss"] for r in read_jsonl(t / "out" / "metrics.jsonl") if "loss" in r] for t in (tmp_path / "a",
                                                                                                     tmp_path / "b")]
    assert losses[0][2] == losses[1][-1]


def _pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor):
    """``[E, R, G, 32]`` 4-bit codes and ``[E, R, G]`` biased exponents -> MXFP4 blocks and scales as gpt-oss stores
    them: two codes a byte, the even-indexed value in the low nibble."""
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [E, R, G, 16]
    return blocks, exponents.to(torch.uint8)


def test_gpt_oss_mxfp4_experts_are_dequantised_on_load_and_saved_unquantised(moe_dir, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    bf16 = make_family_dir("gpt_oss", tmp_path / "bf16", dtype=torch.bfloat16)
    src = tmp_path / "mxfp4"
    src.mkdir()
    tensors = load_file(bf16 / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    expected = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, rows = tensors.pop(key).shape  # in memory [E, H, 2I] / [E, I, H]: stored [E, rows, inputs]
        codes = torch.randint(0, 16, (experts, rows, inputs // 32, 32), generator=gen)
        exponents = torch.randint(127 - 6, 127 + 1, (experts, rows, inputs // 32), generator=gen)
        tensors[key + "_blocks"], tensors[key + "_scales"] = _pack_mxfp4(codes, exponents)
        # value = code's E2M1 value x 2^(exponent - 127), one scale per 32 inputs; transformers' layout [E, in, out].
        value = lut[codes] * torch.exp2(exponents.float() - 127)[..., None]  # [E, rows, G, 32]
        expected[key] = value.reshape(experts, rows, inputs).transpose(1, 2)
        # ... which is what transformers' own MXFP4 dequantisation gives (bf16 represents every value exactly).
        assert torch.equal(convert_moe_packed_tensors(tensors[key + "_blocks"], tensors[key + "_scales"]).float(),
                           expected[key])
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (src / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (src / name).write_bytes((bf16 / name).read_bytes())

    # The policy built from the MXFP4 directory computes what transformers' own dequantising load does (cast to fp32
    # after loading: transformers dequantises the whole model to bf16). The same modules on the same weights: 1e-5.
    from transformers import AutoModelForCausalLM, Mxfp4Config

    theirs = AutoModelForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True)).float().eval()
    tokens = _tokens((24,))
    with torch.no_grad():
        torch.testing.assert_close(_policy(src, tmp_path)(tokens), theirs(tokens).logits, atol=1e-5, rtol=0)

    checkpointer = HFCheckpointer(str(src), str(tmp_path / "out"))
    state = checkpointer.load_checkpoint()["model"]
    for key, value in expected.items():
        assert state[key].dtype == torch.bfloat16 and torch.equal(state[key].float(), value), key
    step = checkpointer.save_checkpoint({"model": state}, 0)
    saved = json.loads((step / "config.json").read_text())
    assert "quantization_config" not in saved and saved["model_type"] == "gpt_oss"
    assert set(expected) <= _names(step) and not any(k.endswith(("_blocks", "_scales")) for k in _names(step))
    # transformers loads the unquantised step directory with the dequantised experts.
    reloaded = _hf(step).state_dict()
    for key, value in expected.items():
        assert torch.equal(reloaded[key], value), key


def test_other_quantisation_is_refused_by_name(moe_dir, tmp_path):
    src = tmp_path / "q"
    src.mkdir()
    for f in moe_dir("qwen3_moe").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match=r"quantization_config.quant_method = 'fp8' is not supported"):
        HFCheckpointer(str(src), str(tmp_path / "out"))
