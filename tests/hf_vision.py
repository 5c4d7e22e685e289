"""Tiny multimodal directories with what an image prompt needs besides the weights: the image tokens in the
tokenizer, an image processor, and a chat template that places images, as the real Qwen3.5, Gemma 3 and Gemma 4
checkpoints ship them. Built in code from :func:`tests.hf_multimodal.make_multimodal_dir` (no download).

``make_vision_dir(family, directory)`` writes, next to the weights and tokenizer files:

- ``tokenizer_config.json`` with the family's image tokens named (``image_token``, ``boi_token``, ...), as the
  real files name them, so the processor classes find them;
- the image processor's configuration, sized for the one-layer towers of :func:`multimodal_config`: Qwen3.5
  ``Qwen2VLImageProcessor`` with 4-pixel patches merged 2x2 (an image of ``h x w`` pixels, resized to multiples
  of 8, becomes ``h*w/64`` image tokens); Gemma 3 ``Gemma3ImageProcessor`` at 16x16 (4 image tokens, the
  config's ``mm_tokens_per_image``); Gemma 4 ``Gemma4ImageProcessor`` at its smallest budget, 70 soft tokens
  (4-pixel patches pooled 2x2);
- ``chat_template.jinja``: the text family's template (:mod:`tests.family_templates`) extended to message
  contents that are lists of ``{"type": "image"}`` and ``{"type": "text", "text": ...}`` items, placing the
  family's image marker (Qwen3.5 ``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3 ``<start_of_image>``,
  Gemma 4 ``<|image|>``); a string content renders exactly as the text template does.

What loads offline in this environment (transformers 5.19, no torchvision): ``AutoProcessor.from_pretrained`` on
the Gemma 3 directory (``Gemma3Processor``: tokenizer + image processor only). Qwen3.5's ``Qwen3VLProcessor`` and
Gemma 4's ``Gemma4Processor`` also hold a video processor, which transformers builds only with torchvision
installed: on those directories (as on the real checkpoints) ``AutoProcessor`` raises an ImportError naming
torchvision here, while ``AutoTokenizer`` and ``AutoImageProcessor`` load. :func:`processor_inputs` gives the
model inputs of an image prompt for all three families: the processor's own output where it loads, else the
tokenizer and image processor with the image-token expansion the processor class documents (Qwen3.5: each
``<|image_pad|>`` becomes ``grid_t*grid_h*grid_w / merge_size**2`` of them; Gemma 4: each ``<|image|>`` becomes
``<|image>`` + ``num_soft_tokens`` x ``<|image|>`` + ``<image|>``), with ``mm_token_type_ids`` (1 on image
tokens) as those processors return it.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

from tests import family_templates as T
from tests.hf_multimodal import make_multimodal_dir, TEXT_FAMILY

__all__ = ["IMAGE_MARKER", "VISION_FAMILIES", "make_vision_dir", "processor_inputs", "shape_image", "with_image_tokens"]

VISION_FAMILIES = ("qwen3_5", "gemma3", "gemma4")

# The text the chat template writes for one image (the processor expands it to the image's tokens).
IMAGE_MARKER = {"qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>", "gemma3": "<start_of_image>",
                "gemma4": "<|image|>"}
IMAGE_MARKER["qwen3_5_moe"] = IMAGE_MARKER["qwen3_5"]
# tokenizer_config.json's names for the image tokens (the processors read them off the tokenizer).
_TOKEN_NAMES = {
    "qwen3_5": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"},
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "gemma4": {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
               "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"},
}
_TOKEN_NAMES["qwen3_5_moe"] = _TOKEN_NAMES["qwen3_5"]  # the mixture of experts ships Qwen3.5's image files

# A message's content, string or list of items, as one string in ``ns.text`` (``marker``: an image's text).
_CONTENT = """{%- set ns = namespace(text='') %}
    {%- if message['content'] is string %}
        {%- set ns.text = message['content'] %}
    {%- else %}
        {%- for item in message['content'] %}
            {%- if item['type'] == 'image' %}
                {%- set ns.text = ns.text + 'MARKER' %}
            {%- elif item['type'] == 'text' %}
                {%- set ns.text = ns.text + item['text'] %}
            {%- endif %}
        {%- endfor %}
    {%- endif %}"""


def _template(family: str) -> str:
    """The text family's chat template with ``message['content']`` / ``message.content`` read through
    :data:`_CONTENT` (same output for string contents)."""
    content = _CONTENT.replace("MARKER", IMAGE_MARKER[family])
    if family in ("qwen3_5", "qwen3_5_moe"):
        return T.QWEN3_5.replace("{%- for message in messages %}", "{%- for message in messages %}\n    " + content
                                 ).replace("message.content", "ns.text")
    source = T.GEMMA3 if family == "gemma3" else T.GEMMA4
    loop = "{%- for message in loop_messages %}" if family == "gemma3" else "{%- for message in messages %}"
    return source.replace(loop, loop + "\n    " + content).replace("message['content'] | trim", "ns.text | trim")


def _image_processor(family: str):
    if family in ("qwen3_5", "qwen3_5_moe"):
        from transformers import Qwen2VLImageProcessorPil

        # 4-pixel patches (the tower's patch_size), 2x2 merged, two frames per image (temporal_patch_size);
        # sides resized to multiples of 8 with 64 <= h*w <= 1024 pixels: 1 to 16 image tokens.
        return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                        size={"shortest_edge": 64, "longest_edge": 1024})
    if family == "gemma3":
        from transformers import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    from transformers import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)


def make_vision_dir(family: str, directory, *, seed: int = 0, peaked: bool = True, **text_overrides) -> Path:
    """Write ``family``'s tiny multimodal checkpoint with its image prompt files (see the module docstring).

    Args:
        family (str): ``qwen3_5``, ``qwen3_5_moe`` (Qwen3.5's image files), ``gemma3`` or ``gemma4``.
        directory: where to write (created if needed).
        seed (int): the weights' seed. Default is 0.
        peaked (bool): sharpen the language model's attention (:func:`tests.hf_families.sharpen`). Default is True.
        **text_overrides: fields of the ``text_config`` (e.g. ``layer_types``: Gemma 3 with full attention only).

    Returns:
        Path: ``directory``.
    """
    from transformers import AutoTokenizer

    directory = make_multimodal_dir(family, directory, seed=seed, peaked=peaked, **text_overrides)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["extra_special_tokens"] = _TOKEN_NAMES[family]
    config_path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    template = _template(family)
    image_processor = _image_processor(family)
    if family == "gemma3":
        from transformers import Gemma3Processor

        processor = Gemma3Processor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(directory),
                                    chat_template=template, image_seq_length=4)
        processor.save_pretrained(directory)
    else:  # the processor class needs torchvision here (module docstring): its parts, as the real files hold them
        image_processor.save_pretrained(directory)
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    return directory


def shape_image(kind: str, size=(24, 16), color=(220, 40, 40)):
    """A PIL image of ``size`` (width, height): a filled ``"square"``, ``"circle"`` or ``"triangle"`` on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    w, h = size
    box = (w // 6, h // 6, w - w // 6, h - h // 6)
    if kind == "square":
        draw.rectangle(box, fill=color)
    elif kind == "circle":
        draw.ellipse(box, fill=color)
    else:
        draw.polygon([(w // 2, h // 6), (w // 6, h - h // 6), (w - w // 6, h - h // 6)], fill=color)
    return image


def processor_inputs(family: str, directory, text: str, images: Sequence[Any]) -> Dict[str, torch.Tensor]:
    """The model inputs of one prompt ``text`` (with the family's :data:`IMAGE_MARKER` per image) and ``images``.

    Returns:
        Dict[str, torch.Tensor]: ``input_ids [1, L]`` and the family's image inputs (``pixel_values``, ...; see the
        module docstring for how they are made).
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if family == "gemma3":
        out = AutoProcessor.from_pretrained(directory)(text=[text], images=[list(images)], return_tensors="pt")
        return {k: v for k, v in out.items() if k != "attention_mask"}
    tok = AutoTokenizer.from_pretrained(directory)
    processed = AutoImageProcessor.from_pretrained(directory)(images=list(images), return_tensors="pt")
    names = _TOKEN_NAMES[family]
    pieces: List[str] = text.split(names["image_token"])
    if len(pieces) - 1 != len(images):
        raise ValueError(f"{len(pieces) - 1} image markers for {len(images)} images")
    out_text = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        if family in ("qwen3_5", "qwen3_5_moe"):
            n = int(processed["image_grid_thw"][i].prod()) // 4  # merge_size ** 2
            out_text += names["image_token"] * n + piece
        else:
            n = int(processed["num_soft_tokens_per_image"][i])
            out_text += names["boi_token"] + names["image_token"] * n + names["eoi_token"] + piece
    ids = torch.tensor([tok(out_text, add_special_tokens=False)["input_ids"]])
    image_id = tok.convert_tokens_to_ids(names["image_token"])
    out = {"input_ids": ids, "mm_token_type_ids": (ids == image_id).long(), "pixel_values": processed["pixel_values"]}
    if family in ("qwen3_5", "qwen3_5_moe"):
        out["image_grid_thw"] = processed["image_grid_thw"]
    else:
        out["image_position_ids"] = processed["image_position_ids"]
    return out


def with_image_tokens(directory, tokens: int) -> Path:
    """Gemma 3's ``directory`` with ``tokens`` image tokens per picture (``mm_tokens_per_image`` and the processor's
    ``image_seq_length``; the tower's pooling follows the config, the weights do not depend on it)."""
    directory = Path(directory)
    for name, key in (("config.json", "mm_tokens_per_image"), ("processor_config.json", "image_seq_length")):
        data = json.loads((directory / name).read_text())
        data[key] = tokens
        (directory / name).write_text(json.dumps(data))
    return directory
