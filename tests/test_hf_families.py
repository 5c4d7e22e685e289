"""The tiny family checkpoints (tests/hf_families.py, tests/hf_multimodal.py) are what they claim: every layer
kind present, windows and position scalings that change the numbers, peaked attention, loadable and
sampleable by transformers, each family's own chat template, byte-identical files for one seed, and the
on-disk vs in-memory tensor names their docstrings state."""

import json

import pytest
import torch

from tests.hf_families import (
    FAMILIES,
    LAYER_KINDS,
    MEASURED_PEAKEDNESS,
    PEAKED_MIN,
    WINDOW,
    layer_kinds,
    make_family_dir,
    make_tokenizer,
    peakedness,
    probe_tokens,
)
from tests.hf_multimodal import MULTIMODAL_FAMILIES, TEXT_FAMILY, language_state_dict, make_multimodal_dir
from tests.tolerances import ulps

SLIDING = ("gemma3_text", "gemma4_text", "olmo3", "mistral", "qwen2")
LENGTH = 32  # > every window (6) and YaRN's original length (16)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_family_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def tokens():
    return probe_tokens(LENGTH)  # [1, 32] plain BPE ids


def _load(directory, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits[0]  # [T, V]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_has_every_layer_kind_peaked_attention_and_generates(family, dirs, tokens):
    model = _load(dirs[family], attn_implementation="eager")
    assert model.config.model_type == FAMILIES[family].model_type
    assert layer_kinds(model) == LAYER_KINDS[family]
    # Uniform attention gives 0.03-0.11 over the 9-32 visible keys (0.17 in a 6-token window).
    peak = peakedness(model, tokens)
    assert peak >= PEAKED_MIN, f"{family}: mean max attention probability {peak:.3f}"
    assert abs(peak - MEASURED_PEAKEDNESS[family]) < 0.01, (family, peak)  # the documented value
    logits = _logits(model, tokens)
    assert torch.isfinite(logits).all()
    torch.manual_seed(0)
    out = model.generate(tokens[:, :24], do_sample=True, max_new_tokens=6, min_new_tokens=6)
    assert out.shape == (1, 30) and torch.equal(out[:, :24], tokens[:, :24])


@pytest.mark.parametrize("family", SLIDING)
def test_window_changes_the_last_positions_only(family, dirs, tokens):
    narrow, wide = _logits(_load(dirs[family]), tokens), _logits(_load(dirs[family], sliding_window=4 * LENGTH), tokens)
    assert narrow.shape == wide.shape
    # Positions < WINDOW see all their keys either way: the same operations on the same values (only masked-out
    # entries differ), so equal up to a few ulp of the logits (SDPA may block the masked rows differently).
    assert torch.allclose(narrow[:WINDOW], wide[:WINDOW], rtol=0, atol=ulps(wide[:WINDOW], 16))
    # The last position attends to 6 of its 32 keys in the window: with peaked attention its logits move by
    # more than their own scale (measured 1.17-1.61 x max|logit|), far above any rounding.
    assert (narrow[-1] - wide[-1]).abs().max() > 0.5 * wide[-1].abs().max()


def test_nope_layers_and_llama4_temperature_bite(dirs, tokens):
    # SmolLM3: the 4th layer has no RoPE; giving it RoPE changes the numbers.
    base = _logits(_load(dirs["smollm3"]), tokens)
    roped = _logits(_load(dirs["smollm3"], no_rope_layers=[1, 1, 1, 1]), tokens)
    assert (base - roped).abs().max() > 0.1 * base.abs().max()  # measured 0.39 x max|logit|
    # Ministral 3: queries are scaled by 1 + beta * log(1 + floor(pos / 16)): positions < 16 are unchanged
    # without it, later ones move.
    model = _load(dirs["ministral3"])
    rope = dict(model.config.rope_parameters)
    base = _logits(model, tokens)
    flat = _logits(_load(dirs["ministral3"], rope_parameters={**rope, "llama_4_scaling_beta": 0.0}), tokens)
    assert torch.allclose(base[:16], flat[:16], rtol=0, atol=ulps(base[:16], 16))  # same ops (scale factor 1)
    assert (base[16:] - flat[16:]).abs().max() > 0.02 * base.abs().max()  # measured 0.11 x max|logit|


def test_tokenizers_and_chat_templates_are_each_familys(dirs):
    from transformers import AutoConfig, AutoTokenizer

    from torchtune_grpo.models import hf_tokenizer

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    rendered = {}
    for family, directory in dirs.items():
        tok, spec = hf_tokenizer(str(directory)), FAMILIES[family]
        config = AutoConfig.from_pretrained(directory)
        assert config.vocab_size >= tok.vocab_size
        assert tok.eos_id == config.eos_token_id and (tok.bos_id == config.bos_token_id)
        assert tok.pad_id == (config.pad_token_id if spec.pad else tok.eos_id)
        ids = tok.apply_chat_template(messages)
        assert ids == AutoTokenizer.from_pretrained(directory).apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False), family
        assert all(tok.encode_text(s) == [i] for s, i in zip(spec.specials, range(480, 480 + len(spec.specials))))
        assert tok.eot_id is not None and tok.eot_id in tok.stop_tokens, family
        rendered[family] = tok.render(messages)
    assert len(set(rendered.values())) == len(rendered), rendered  # every family's prompt is its own
    assert rendered["gemma3_text"].startswith("<bos><start_of_turn>user\n")
    assert rendered["phi3"] == "<|user|>What is 2 + 3?<|end|><|assistant|>"
    assert rendered["mistral"] == "<s>[INST] What is 2 + 3?[/INST]"
    assert rendered["qwen3_5_text"].endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("family", ["qwen3_5_text", "gemma4_text", "phi3"])
def test_same_seed_same_bytes(family, dirs, tmp_path):
    again, other = make_family_dir(family, tmp_path / "a"), make_family_dir(family, tmp_path / "b", seed=1)
    names = sorted(p.name for p in dirs[family].iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (dirs[family] / name).read_bytes() == (again / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(again / "tokenizer.json")).to_str() == make_tokenizer(family).to_str()


# On-disk names: what the real checkpoints hold (prefix -> present), as tests/hf_multimodal.py documents.
ON_DISK = {
    "qwen3_5": ["model.language_model.layers.0.linear_attn.", "model.language_model.layers.1.self_attn.",
                "model.visual.blocks.0.", "model.visual.merger.", "mtp.fc.weight"],
    "gemma3": ["language_model.model.layers.2.self_attn.", "vision_tower.vision_model.encoder.layers.0.",
               "multi_modal_projector.mm_input_projection_weight"],
    "gemma4": ["model.language_model.embed_tokens_per_layer.", "model.vision_tower.encoder.",
               "model.audio_tower.layers.0.", "model.embed_vision.", "model.embed_audio."],
}
CAUSAL_LM_CLASS = {"qwen3_5": "Qwen3_5ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
                   "gemma4": "Gemma4ForConditionalGeneration"}


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_multimodal_names_on_disk_and_in_memory(family, tmp_path, tokens):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    directory = make_multimodal_dir(family, tmp_path / family, max_shard_size="100KB" if family == "gemma4" else None)
    files = sorted(directory.glob("*.safetensors"))
    disk = set()
    for file in files:
        with safe_open(file, "pt") as f:
            disk |= set(f.keys())
    for prefix in ON_DISK[family]:
        assert any(k.startswith(prefix) for k in disk), (family, prefix)
    assert "lm_head.weight" not in disk  # tied, as the real ones
    if family == "gemma4":
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        assert len(files) > 1 and set(index["weight_map"]) == disk

    from torchtune_grpo.models import hf_tokenizer

    assert hf_tokenizer(str(directory)).render([{"role": "user", "content": "Hi"}]) == hf_tokenizer(
        str(make_family_dir(TEXT_FAMILY[family], tmp_path / "text"))).render([{"role": "user", "content": "Hi"}])
    full = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    causal = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(causal).__name__ == CAUSAL_LM_CLASS[family]
    text = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory).text_config, dtype=torch.float32)
    missing, unexpected = text.load_state_dict(language_state_dict(family, directory), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the tied head, nothing else
    text.tie_weights()
    # The same modules on the same weights: equal bit for bit.
    assert torch.equal(_logits(text.eval(), tokens), _logits(full, tokens))
    assert torch.equal(_logits(causal, tokens), _logits(full, tokens))
    # What save_pretrained writes back: the on-disk names, without the tensors transformers has no module for
    # (Qwen3.5's mtp.*) and, from the text-only class, without the towers.
    full.save_pretrained(tmp_path / "resaved")
    with safe_open(tmp_path / "resaved" / "model.safetensors", "pt") as f:
        resaved = set(f.keys())
    assert resaved == {k for k in disk if not k.startswith("mtp.")}
