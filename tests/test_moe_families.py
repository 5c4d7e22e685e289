"""The tiny mixture-of-experts checkpoints (tests/hf_moe.py) are what they claim, and the backends take them:
transformers loads and samples them, attention is peaked, routers are decisive, the on-disk layout is the
family's, ``model.backend: auto`` trains them as transformers' module and ``torchtune`` refuses them by name."""

import json

import pytest
import torch
from safetensors import safe_open

from tests.hf_families import PEAKED_MIN, layer_kinds, make_family_dir, peakedness, probe_tokens
from tests.hf_moe import (
    DISK_EXPERT_NAMES,
    MEASURED_PEAKEDNESS,
    MEASURED_ROUTER_MARGIN,
    MOE_FAMILY_NAMES,
    MOE_LAYER_KINDS,
    router_margins,
    routers,
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: make_family_dir(f, root / f) for f in MOE_FAMILY_NAMES}


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_moe_fixture_is_peaked_decisive_and_in_the_familys_layout(family, dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchtune_grpo.models import hf_tokenizer

    directory = dirs[family]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    assert layer_kinds(model) == MOE_LAYER_KINDS[family]
    assert len(routers(model)) == model.config.num_hidden_layers  # every layer routes
    tokens = probe_tokens(32)
    peak = peakedness(model, tokens)
    assert peak >= PEAKED_MIN and abs(peak - MEASURED_PEAKEDNESS[family]) < 0.01, (family, peak)
    # Decisive routers: the k-th/(k+1)-th logit gap is >= 1e-3 for every (token, layer) (fp32 rounding moves a
    # logit of magnitude ~5 by ~1e-6), and typically ~2 (an unscaled random router gives a median ~0.5).
    margins = router_margins(model, tokens)  # [layers, 32]
    low, median = MEASURED_ROUTER_MARGIN[family]
    assert abs(float(margins.min()) - low) < 1e-3 and abs(float(margins.median()) - median) < 1e-2, margins
    assert float(margins.min()) > 1e-3
    torch.manual_seed(0)
    out = model.generate(tokens[:, :24], do_sample=True, max_new_tokens=4, min_new_tokens=4)
    assert out.shape == (1, 28)
    files = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values() if (
        directory / "model.safetensors.index.json").is_file() else ["model.safetensors"]
    names = set()
    for name in set(files):
        with safe_open(str(directory / name), "pt") as f:
            names.update(f.keys())
    assert set(DISK_EXPERT_NAMES[family]) <= names, sorted(names)[:20]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert hf_tokenizer(str(directory)).apply_chat_template(messages) == AutoTokenizer.from_pretrained(
        directory).apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_gpt_oss_bf16_directory(tmp_path):
    # The bf16 checkpoint a gpt-oss user trains from (converted from MXFP4): every tensor bf16 on disk.
    directory = make_family_dir("gpt_oss", tmp_path / "g", dtype=torch.bfloat16)
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


@pytest.mark.parametrize("family", MOE_FAMILY_NAMES)
def test_moe_goes_to_transformers_and_torchtune_refuses_it_by_name(family, dirs):
    from torchtune_grpo.models import choose_backend

    config = json.loads((dirs[family] / "config.json").read_text())
    chosen = choose_backend(config)
    assert chosen.name == "transformers" and "mixture-of-experts" in chosen.reason
    model_type = config.get("text_config", config)["model_type"]
    refusal = rf"model_type '{model_type}'.*mixture-of-experts.*model.backend: transformers"
    with pytest.raises(ValueError, match=refusal):
        choose_backend(config, "torchtune")


def test_gpt_oss_window_bites(dirs):
    # gpt-oss's sliding layers attend to 6 keys: widening the window leaves positions < 6 as they are (the same keys;
    # a few ulp from SDPA/eager blocking the masked rows differently) and moves the last position's logits by more
    # than rounding ever could (measured 1.22 x max|logit|).
    from transformers import AutoModelForCausalLM

    from tests.tolerances import ulps

    tokens = probe_tokens(32)
    with torch.no_grad():
        narrow, wide = (AutoModelForCausalLM.from_pretrained(dirs["gpt_oss"], dtype=torch.float32, **kw).eval()(
            tokens).logits[0] for kw in ({}, {"sliding_window": 128}))
    assert torch.allclose(narrow[:6], wide[:6], rtol=0, atol=ulps(wide[:6], 16))
    assert (narrow[-1] - wide[-1]).abs().max() > 0.5 * wide[-1].abs().max()
