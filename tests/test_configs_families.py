"""The shipped configs of the families transformers' own modules serve (Qwen3.5, Gemma 3, Gemma 4, OLMo 3,
SmolLM3, Phi-4-mini, and the mixtures of experts Qwen3-MoE, Qwen3.5-MoE, gpt-oss) build as the recipe builds them.

Two checks per config, neither loading a real checkpoint:

- from a tiny random checkpoint of the config's family, made by transformers (``tests/hf_families.py``, and
  ``tests/hf_multimodal.py`` where the real checkpoint is multimodal on disk), after editing only
  ``checkpointer.checkpoint_dir``: the model, the tokenizer and the checkpointer are instantiated from the
  config, the backend chosen is transformers' with the family's own class, the weights the checkpointer reads
  are exactly the model's tensors, and the chat prompt is the family's own template with the config's system
  prompt and thinking switch;
- from the real model's ``config.json`` (``tests/real_hf_configs.py``), on the meta device: the parameter count
  the config's memory comment is worked out from is the real model's, and its lengths fit the model.

The image configs (``*_image_grpo``: images in the prompt, docs/multimodal.md) are built from a tiny directory
that also has the family's image processor and image chat template (``tests/hf_vision.py``), and their dataset is
built too, from a local file with the columns of the Hub dataset they name; their memory comment's vision-tower
count is the real tower's (the image-text class of the real ``config.json``, on the meta device).
"""

from pathlib import Path
from typing import Dict, NamedTuple

import json
import re

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

from tests.hf_families import family_spec, make_family_dir, make_tokenizer
from tests.hf_multimodal import TEXT_FAMILY, make_multimodal_dir
from tests.hf_vision import IMAGE_MARKER, make_vision_dir, shape_image
from tests.real_hf_configs import FAMILY_HUB_CONFIGS
from tests.test_configs import CONFIG_DIR, assert_real_config_conventions
from torchtune_grpo.checkpoints.checkpointer_facts import instantiate_checkpointer
from torchtune_grpo.models import hf_model


class Fixture(NamedTuple):
    """The tiny checkpoint a config is built from: ``family`` of :mod:`tests.hf_families` (text on disk) or
    :mod:`tests.hf_multimodal` (``multimodal``), its head tied to the embeddings or not as the real model's
    (``tied``); ``causal_lm`` is the transformers class the policy must be; ``images``: the config trains on
    image prompts, and the directory has the image processor and chat template of :mod:`tests.hf_vision`."""

    family: str
    multimodal: bool
    tied: bool
    causal_lm: str
    images: bool = False


QWEN3_5 = Fixture("qwen3_5", True, True, "Qwen3_5ForCausalLM")
FIXTURES: Dict[str, Fixture] = {
    "qwen3_5/0.8B_full_grpo": QWEN3_5,
    "qwen3_5/0.8B_lora_grpo": QWEN3_5,
    "qwen3_5/2B_full_grpo": QWEN3_5,
    "qwen3_5/2B_lora_grpo": QWEN3_5,
    "qwen3_5/4B_full_grpo": QWEN3_5,
    "qwen3_5/4B_lora_grpo": QWEN3_5,
    "qwen3_5/9B_full_grpo": QWEN3_5._replace(tied=False),  # Qwen3.5-9B's head is its own (lm_head.weight)
    "qwen3_5/9B_lora_grpo": QWEN3_5._replace(tied=False),
    "qwen3_5/2B_image_grpo": QWEN3_5._replace(images=True),
    "qwen3_5/4B_image_grpo": QWEN3_5._replace(images=True),
    "gemma3/4B_image_grpo": Fixture("gemma3", True, True, "Gemma3ForCausalLM", images=True),
    "gemma3/1B_full_grpo": Fixture("gemma3_text", False, True, "Gemma3ForCausalLM"),  # Gemma 3 1B is text-only
    "gemma3/4B_full_grpo": Fixture("gemma3", True, True, "Gemma3ForCausalLM"),
    "gemma4/E2B_full_grpo": Fixture("gemma4", True, True, "Gemma4ForCausalLM"),
    "olmo3/7B_full_grpo": Fixture("olmo3", False, False, "Olmo3ForCausalLM"),
    "smollm3/3B_full_grpo": Fixture("smollm3", False, True, "SmolLM3ForCausalLM"),
    "phi4_mini/3.8B_full_grpo": Fixture("phi3", False, True, "Phi3ForCausalLM"),
    # Mixtures of experts (tests/hf_moe.py), all with their own output head.
    "qwen3_moe/30B-A3B_full_grpo": Fixture("qwen3_moe", False, False, "Qwen3MoeForCausalLM"),
    "qwen3_moe/30B-A3B_lora_grpo": Fixture("qwen3_moe", False, False, "Qwen3MoeForCausalLM"),
    "gpt_oss/20B_lora_grpo": Fixture("gpt_oss", False, False, "GptOssForCausalLM"),
    "qwen3_5_moe/35B-A3B_lora_grpo": Fixture("qwen3_5_moe", True, False, "Qwen3_5MoeForCausalLM"),
}
FAMILY_FOLDERS = ("qwen3_5", "gemma3", "gemma4", "olmo3", "smollm3", "phi4_mini", "qwen3_moe", "gpt_oss", "qwen3_5_moe")


def test_every_family_config_has_a_fixture():
    shipped = {f"{folder}/{p.stem}" for folder in FAMILY_FOLDERS for p in (CONFIG_DIR / folder).glob("*.yaml")}
    assert shipped == set(FIXTURES)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Fixture -> its tiny checkpoint directory, made once per module (a few tenths of a second each)."""
    made: Dict[Fixture, Path] = {}

    def get(fixture: Fixture) -> Path:
        if fixture not in made:
            directory = tmp_path_factory.mktemp(fixture.family)
            if fixture.images:
                assert fixture.tied  # make_vision_dir writes the family's default, tied
                made[fixture] = make_vision_dir(fixture.family, directory)
            else:
                maker = make_multimodal_dir if fixture.multimodal else make_family_dir
                made[fixture] = maker(fixture.family, directory, tie_word_embeddings=fixture.tied)
        return made[fixture]

    return get


def _text_family(fixture: Fixture) -> str:
    return TEXT_FAMILY[fixture.family] if fixture.multimodal else fixture.family


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_family_config_builds_from_a_tiny_directory_of_its_family(name: str, tiny_dirs, tmp_path: Path):
    fixture = FIXTURES[name]
    cfg = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
    real_dir = assert_real_config_conventions(cfg)
    assert FAMILY_HUB_CONFIGS[real_dir.name]["tie_word_embeddings"] is fixture.tied  # the fixture is tied as the model
    directory = tiny_dirs(fixture)
    cfg.checkpointer.checkpoint_dir = str(directory)  # the one line a user edits
    cfg.output_dir = str(tmp_path / "out")

    model = tt_config.instantiate(cfg.model)
    assert type(model).__name__ == "TransformersDecoder"
    assert fixture.causal_lm in model.backend_note and "model.backend: auto" in model.backend_note
    checkpointer = instantiate_checkpointer(cfg)
    assert checkpointer.backend == "transformers"
    state = checkpointer.load_checkpoint()["model"]
    # The checkpointer reads exactly the policy's tensors (the towers of a multimodal directory stay on disk);
    # LoRA adds adapters the checkpoint does not have.
    policy = {k: tuple(v.shape) for k, v in model.state_dict().items() if "lora_" not in k}
    assert {k: tuple(v.shape) for k, v in state.items()} == policy
    if "lora" in name:
        assert any("lora_" in k for k in model.state_dict())
    assert model.causal_lm.config.tie_word_embeddings is fixture.tied
    assert ("lm_head.weight" in state) is not fixture.tied

    tokenizer = tt_config.instantiate(cfg.tokenizer)
    messages = [{"role": "system", "content": cfg.dataset.system_prompt}, {"role": "user", "content": "1 + 1?"}]
    prompt = tokenizer.decode(tokenizer.apply_chat_template(messages), skip_special_tokens=False)
    assert cfg.dataset.system_prompt in prompt and "1 + 1?" in prompt
    thinking = cfg.tokenizer.get("enable_thinking", None)
    if fixture.family in ("qwen3_5", "qwen3_5_moe"):  # the generation prompt opens a thinking block, closed empty when off
        assert prompt.endswith("<think>\n\n</think>\n\n" if thinking is False else "<|im_start|>assistant\n<think>\n")
    if fixture.family == "smollm3":
        assert "Reasoning Mode: /no_think" in prompt and thinking is False
    # Generation stops at the family's end of turn (generation_config.json's eos_token_id).
    family_tokenizer = make_tokenizer(_text_family(fixture))
    for stop in family_spec(_text_family(fixture)).stops:
        assert family_tokenizer.token_to_id(stop) in tokenizer.stop_tokens, stop
    if fixture.images:
        _assert_image_dataset_builds(cfg, tokenizer, fixture, tmp_path)


def _assert_image_dataset_builds(cfg, tokenizer, fixture: Fixture, tmp_path: Path) -> None:
    """The config's image dataset, built as the recipe builds it, from a local parquet file with the columns and
    types of the Hub dataset it names (hiyouga/geometry3k: ``images``, a list of images; ``problem`` and
    ``answer``, strings, the problem starting with a literal ``<image>``): each row's one image is in its prompt
    where the marker stood (the marker gone from the text), with the config's system prompt, and the gold answer
    is the row's."""
    import io

    from datasets import Dataset, Features, Image, Sequence, Value

    assert cfg.dataset.source == "hiyouga/geometry3k"

    def png(kind):
        buffer = io.BytesIO()
        shape_image(kind).save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}

    features = Features({"images": Sequence(Image()), "problem": Value("string"), "answer": Value("string")})
    rows = Dataset.from_dict({"images": [[png("triangle")], [png("circle")]],
                              "problem": ["<image>Find x.", "<image>Find the area of the circle."],
                              "answer": ["3", "4 \\pi"]}, features=features)
    rows.to_parquet(str(tmp_path / "train.parquet"))
    cfg.dataset.source, cfg.dataset.data_files = "parquet", str(tmp_path / "train.parquet")
    data = tt_config.instantiate(cfg.dataset, tokenizer)
    assert len(data) == 2
    for item, problem, answer in zip(data, rows["problem"], rows["answer"]):
        assert item["num_images"] == 1 and item["answer"] == answer
        assert item["prompt"].count(IMAGE_MARKER[fixture.family]) == 1
        assert cfg.dataset.system_prompt in item["prompt"] and problem.removeprefix("<image>") in item["prompt"]
        assert "<image>" not in item["prompt"].replace(IMAGE_MARKER[fixture.family], "")
        assert "pixel_values" in item["image_inputs"] and len(item["tokens"]) <= cfg.max_prompt_length


def _comment_parameters(text: str) -> int:
    counts = {int(m.replace(",", "")) for m in re.findall(r"([\d,]{11,}) language-model parameters", text)}
    assert len(counts) == 1, counts
    return counts.pop()


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_family_config_memory_comment_counts_the_real_model(name: str, tmp_path: Path):
    path = CONFIG_DIR / f"{name}.yaml"
    cfg = OmegaConf.load(path)
    real = tmp_path / Path(str(cfg.checkpointer.checkpoint_dir)).name
    real.mkdir()
    (real / "config.json").write_text(json.dumps(FAMILY_HUB_CONFIGS[real.name]))
    # On the meta device (transformers' module of the real config.json, no memory); building for the config's
    # lengths checks they fit max_position_embeddings.
    with torch.device("meta"):
        model = hf_model(str(real), max_seq_len=cfg.max_prompt_length + cfg.max_response_length)
    assert next(model.parameters()).is_meta
    assert FIXTURES[name].causal_lm in model.backend_note
    parameters = sum(p.numel() for p in model.parameters())  # a tied head is the embedding: counted once
    text = path.read_text()
    assert _comment_parameters(text) == parameters
    # The estimate's terms use that count: 16 bytes each (fp32 master, gradient, AdamW) or 2 (frozen bf16 base).
    billions = f"{parameters / 1e9:.2f}B"
    if "lora" in name:
        assert f"{billions} parameters x 2 bytes = {2 * parameters / 1e9:.1f} GB" in text
        # The adapters the config's LoRA keys give the real model (on the meta device: no memory).
        cfg.checkpointer.checkpoint_dir = str(real)
        with torch.device("meta"):
            lora = tt_config.instantiate(cfg.model)
        adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
        assert f"trainable parameters: {adapters / 1e6:.0f}M of {billions}" in text
        assert f"8 bytes x {adapters / 1e6:.0f}M = {8 * adapters / 1e9:.1f} GB" in text
    else:
        assert f"16 bytes/parameter x {billions} = {16 * parameters / 1e9:.1f} GB" in text
    assert model.max_seq_len == cfg.max_prompt_length + cfg.max_response_length
    if FIXTURES[name].images:
        _assert_vision_terms(text, real.name, parameters)


def _assert_vision_terms(text: str, hub_name: str, language_parameters: int) -> None:
    """An image config's memory comment counts the real vision tower and projector (the image-text class of the
    real config.json on the meta device), loaded in fp32 for the policy (dtype bf16: its parameter dtype) and in
    bf16 for the reference, and states the family's image tokens as the real config gives them."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(**FAMILY_HUB_CONFIGS[hub_name])
    with torch.device("meta"):
        full = AutoModelForImageTextToText.from_config(config)
    # Everything outside the language model (a tied head is the embedding: named once, as the embedding).
    vision = sum(p.numel() for n, p in full.named_parameters()
                 if ".language_model." not in n and not n.startswith("lm_head"))
    assert sum(p.numel() for p in full.parameters()) == language_parameters + vision
    counts = {int(m.replace(",", "")) for m in re.findall(r"([\d,]{11,}) vision-tower and \w+ parameters", text)}
    assert counts == {vision}, counts
    millions = f"{vision / 1e6:.0f}M"
    assert f"4 bytes x {millions} = {4 * vision / 1e9:.1f} GB" in text  # the policy's copy (fp32)
    assert f"2 bytes x {millions} = {2 * vision / 1e9:.1f} GB" in text  # the reference's (bf16)
    if config.model_type == "gemma3":
        size = config.vision_config.image_size
        assert f"{size} x {size}" in text and f"{config.mm_tokens_per_image} image tokens per image" in text
    else:  # Qwen3.5: one token per merged patch
        side = config.vision_config.patch_size * config.vision_config.spatial_merge_size
        assert f"one token per {side} x {side} pixels" in text
