"""A model directory's own processor for image prompts: chat template, image tokens, resizing.

:func:`load_image_processor` returns transformers' ``AutoProcessor`` of the directory. Where that cannot be built
because the processor class also holds a video processor and transformers builds video processors only with
torchvision installed (Qwen3.5's ``Qwen3VLProcessor``, Gemma 4's ``Gemma4Processor``; this package does not depend
on torchvision), it returns :class:`ImageTokenProcessor`: the directory's own tokenizer (and chat template) and
image processor, with the image-token expansion those processor classes perform for images (their
``replace_image_token``), so the prompt's tokens and image tensors are the ones the processor would give:

- Qwen3.5: each ``<|image_pad|>`` becomes ``grid_t * grid_h * grid_w / merge_size**2`` copies (one per merged
  patch the tower outputs); ``mm_token_type_ids`` is 1 on them (M-RoPE positions are computed from it);
- Gemma 4: each ``<|image|>`` becomes ``<|image>`` + ``num_soft_tokens`` x ``<|image|>`` + ``<image|>``;
  ``mm_token_type_ids`` is 1 on the soft tokens.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["ImageTokenProcessor", "load_image_processor"]

# model_type -> how its processor expands one image's placeholder: "grid" (Qwen) or "soft_tokens" (Gemma 4).
_EXPANSION = {"qwen3_5": "grid", "qwen3_5_moe": "grid", "qwen3_vl": "grid", "qwen3_vl_moe": "grid",
              "gemma4": "soft_tokens"}


class ImageTokenProcessor:
    """The processor of a directory whose processor class needs torchvision (see the module docstring).

    Args:
        tokenizer (Any): the directory's transformers tokenizer (with its chat template).
        image_processor (Any): the directory's transformers image processor.
        expansion (str): ``"grid"`` or ``"soft_tokens"``.
    """

    def __init__(self, tokenizer: Any, image_processor: Any, expansion: str) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.expansion = expansion
        self.image_token = getattr(tokenizer, "image_token", None) or (
            "<|image_pad|>" if expansion == "grid" else "<|image|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    def apply_chat_template(self, messages: List[Dict[str, Any]], **kwargs: Any) -> str:
        """The tokenizer's chat template (image items become the family's image marker)."""
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text: Sequence[str], images: Sequence[Sequence[Any]], return_tensors: str = "pt") -> Dict:
        """``input_ids [1, L]``, ``mm_token_type_ids [1, L]`` and the image processor's outputs for one prompt.

        Raises:
            ValueError: when the text holds another number of image placeholders than there are images.
        """
        import torch

        if len(text) != 1 or len(images) != 1:
            raise ValueError("ImageTokenProcessor takes one prompt at a time")
        pictures = list(images[0])
        processed = self.image_processor(images=pictures, return_tensors="pt")
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(pictures):
            raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders ({self.image_token}) for "
                             f"{len(pictures)} images")
        out_text = pieces[0]
        for i, piece in enumerate(pieces[1:]):
            if self.expansion == "grid":
                merge = int(getattr(self.image_processor, "merge_size", 2))
                n = int(processed["image_grid_thw"][i].prod()) // merge**2
                out_text += self.image_token * n + piece
            else:
                n = int(processed["num_soft_tokens_per_image"][i])
                out_text += self.tokenizer.boi_token + self.image_token * n + self.tokenizer.eoi_token + piece
        ids = torch.tensor([self.tokenizer(out_text, add_special_tokens=False)["input_ids"]])
        out = {"input_ids": ids, "mm_token_type_ids": (ids == self.image_token_id).long()}
        out.update({k: v for k, v in processed.items() if k != "num_soft_tokens_per_image"})
        return out


def load_image_processor(model_dir: str) -> Any:
    """The processor of ``model_dir`` for image prompts (see the module docstring).

    Args:
        model_dir (str): the model directory.

    Returns:
        Any: a transformers processor, or an :class:`ImageTokenProcessor`; either takes
        ``(text=[prompt], images=[[image, ...]], return_tensors="pt")`` and has ``apply_chat_template``.

    Raises:
        ImportError: when the processor needs torchvision and the family's image-token expansion is not known here.
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except ImportError as err:
        chain = f"{err} {err.__cause__}".lower()
        model_type = _model_type(model_dir)
        if "torchvision" not in chain or model_type not in _EXPANSION:
            raise
    return ImageTokenProcessor(AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir),
                               _EXPANSION[model_type])


def _model_type(model_dir: str) -> Optional[str]:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text(encoding="utf-8")).get("model_type") if path.is_file() else None
