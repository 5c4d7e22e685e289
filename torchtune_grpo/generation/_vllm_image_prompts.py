"""Image prompts for the vLLM engines: what vLLM is given for each prompt, and the image-text class's weight names.

The trainer's prompt (``image_dataset``'s ``tokens``) holds each picture's tokens already expanded by the directory's
processor, and its ``image_inputs`` hold the processed pixels. vLLM wants neither: it expands every image marker of
a prompt itself (and expands an already expanded prompt again), and it runs the directory's image processor on the
pictures it is given. So each prompt goes to vLLM as (:class:`VLLMImagePrompts`):

- its tokens with every picture's expansion folded back into ONE image marker (the family's rule below); the
  engine then checks that vLLM's expansion gives back exactly the trainer's tokens (:meth:`check_expanded`);
- its pictures as 8-bit RGB images at the processed size, recovered from ``pixel_values`` (un-normalised and, for
  the patch families, un-patchified). The processor resizes a picture already at its size to itself and rescales
  and normalises it exactly as it did for the trainer, so vLLM's pixels are the trainer's; pixels that are not an
  8-bit picture's (a processor that resized in floating point) are refused, naming the prompt.

The rules, per family (what transformers' processor writes for one marker):

- Gemma 3: ``<start_of_image>`` -> ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x ``<image_soft_token>`` +
  ``<end_of_image>\\n\\n``; pixels ``[images, 3, H, W]``.
- Qwen3.5 (and Qwen3.5-MoE): ``<|image_pad|>`` (between ``<|vision_start|>`` and ``<|vision_end|>``, which stay) -> one
  ``<|image_pad|>`` per merged patch; pixels are patches ``[patches, 3*T*P*P]`` with ``image_grid_thw``.
- Gemma 4: ``<|image|>`` -> ``<|image>`` + one ``<|image|>`` per soft token + ``<image|>``; pixels are patches
  ``[images, max_patches, P*P*3]`` with ``image_position_ids`` (-1 on padding).

Weight names (:class:`ImageTextNames`): vLLM builds an image-text directory as its image-text class and loads it
under the checkpoint's names. The trainer's policy holds the language model under the text class's names
(``model.layers.0...``); each is sent under the directory's on-disk name of that tensor
(``language_model.model.layers.0...`` for Gemma 3, ``model.language_model.layers.0...`` for Qwen3.5 and Gemma 4).
Trained vision modules (``train_vision``) arrive already under their on-disk names (the publisher renames them as
the checkpointer does, :func:`~torchtune_grpo.models.image_state_dict`) and pass through.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from torchtune_grpo.models import language_tensor_name

__all__ = ["IMAGE_FAMILIES", "ImageTextNames", "VLLMImagePrompts", "png_data_url"]

#: The families whose image prompts the vLLM engines pass to vLLM.
IMAGE_FAMILIES = ("qwen3_5", "qwen3_5_moe", "gemma3", "gemma4")

# An 8-bit picture's pixels, un-normalised, are integers up to float32 rounding: the processor's rescale and
# normalise are two float32 operations on values of at most ~2 in magnitude (relative error 2^-24 each), which
# un-normalised (x std / rescale_factor, at most 255 / 0.26) are off an integer by under ~1e-4. A picture resized
# in floating point is off by anything in [0, 0.5]. 1e-2 keeps 100x room over the rounding and refuses the rest.
_INTEGER_TOLERANCE = 1e-2


class ImageTextNames:
    """The directory's on-disk name of every language-model tensor, keyed by the policy's (text class) name.

    Args:
        model_dir (str): the image-text directory (``model.safetensors`` or its index).
    """

    def __init__(self, model_dir: str) -> None:
        from safetensors import safe_open

        directory = Path(model_dir)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            keys = list(json.loads(index.read_text())["weight_map"])
        else:
            with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
                keys = list(f.keys())
        self.on_disk = set(keys)
        # The policy's name of an on-disk language tensor: the rule the checkpointer loads the policy with.
        self.disk_name: Dict[str, str] = {language_tensor_name(k): k for k in keys if language_tensor_name(k) != k}

    def __call__(self, name: str) -> str:
        """The name vLLM loads the policy's tensor ``name`` under (unchanged: already on-disk, or not on disk, such
        as a tied ``lm_head.weight``, which vLLM skips as it does for the text class)."""
        return self.disk_name.get(name, name)


class VLLMImagePrompts:
    """Each prompt's tokens with one marker per picture, and its pictures, for vLLM (module docstring).

    Reads the directory's tokenizer (the marker tokens and the text around an expansion) and image processor (the
    normalisation and patch sizes), as vLLM does.

    Args:
        model_dir (str): the image-text directory.
        model_type (str): its ``config.json`` ``model_type``, one of :data:`IMAGE_FAMILIES`.
    """

    def __init__(self, model_dir: str, model_type: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        if model_type not in IMAGE_FAMILIES:
            raise ValueError(f"{model_dir}: no rule for passing {model_type!r} image prompts to vLLM "
                             f"(families: {list(IMAGE_FAMILIES)})")
        self.family = model_type
        tok = AutoTokenizer.from_pretrained(model_dir)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)

        def ids(text: str) -> List[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        def one(name: str) -> int:
            token = getattr(tok, name, None)
            if token is None:
                raise ValueError(f"{model_dir}: the tokenizer names no {name} (tokenizer_config.json)")
            return int(tok.convert_tokens_to_ids(token))

        self.image_id = one("image_token")  # the token repeated once per feature
        if model_type == "gemma3":
            self.marker = one("boi_token")
            self.before, self.after = ids("\n\n") + [self.marker], [one("eoi_token")] + ids("\n\n")
        elif model_type == "gemma4":
            self.marker = self.image_id
            self.before, self.after = [one("boi_token")], [one("eoi_token")]
        else:
            self.marker, self.before, self.after = self.image_id, [], []

    def collapse(self, tokens: Sequence[int], num_images: int, where: str) -> List[int]:
        """``tokens`` with each picture's expansion replaced by one image marker.

        Raises:
            ValueError: naming ``where`` (the prompt), when the expansions are not the family's or their number is
                not ``num_images``.
        """
        tokens = [int(t) for t in tokens]
        out: List[int] = []
        i = found = 0
        nb, na = len(self.before), len(self.after)
        while i < len(tokens):
            if tokens[i] != self.image_id:
                out.append(tokens[i])
                i += 1
                continue
            end = i
            while end < len(tokens) and tokens[end] == self.image_id:
                end += 1
            if out[len(out) - nb:] != self.before or tokens[end:end + na] != self.after:
                raise ValueError(f"{where}: the image tokens at {i}-{end - 1} are not a {self.family} processor's "
                                 f"expansion (expected {self.before} before and {self.after} after them)")
            del out[len(out) - nb:]
            out.append(self.marker)
            found += 1
            i = end + na
        if found != num_images:
            raise ValueError(f"{where}: {found} expanded image(s) in the prompt's tokens for {num_images} picture(s)")
        return out

    @staticmethod
    def check_expanded(expanded: Sequence[int], tokens: Sequence[int], where: str) -> None:
        """Raise unless vLLM's ``expanded`` prompt is the trainer's ``tokens`` (naming ``where`` and the first
        difference): otherwise vLLM would sample continuations of another prompt than the one trained on."""
        expanded, tokens = [int(t) for t in expanded], [int(t) for t in tokens]
        if expanded == tokens:
            return
        at = next((t for t, (a, b) in enumerate(zip(expanded, tokens)) if a != b), min(len(expanded), len(tokens)))
        raise ValueError(f"{where}: vLLM expanded the prompt's image markers into {len(expanded)} tokens, not the "
                         f"trainer's {len(tokens)} (first difference at {at}: {expanded[at:at + 4]} against "
                         f"{tokens[at:at + 4]}); vLLM's processor for this directory is not the trainer's")

    def pictures(self, inputs: Mapping[str, torch.Tensor], where: str) -> List[Any]:
        """The 8-bit RGB pictures (PIL images, at the processed size) whose processing gives ``inputs``' pixels.

        Raises:
            ValueError: naming ``where``, for pixels that are not an 8-bit picture's.
        """
        from PIL import Image

        images = [self._unnormalised(x) for x in self._images(inputs)]
        out = []
        for k, x in enumerate(images):
            off = (x - x.round()).abs().max().item() if x.numel() else 0.0
            if off > _INTEGER_TOLERANCE or x.min() < -0.5 or x.max() > 255.5:
                raise ValueError(f"{where}: picture {k}'s pixels are not an 8-bit picture's after undoing the "
                                 f"processor's normalisation (off an integer by up to {off:.3g}), so vLLM cannot be "
                                 "given the trainer's pixels")
            array = x.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
            out.append(Image.fromarray(array, mode="RGB"))
        return out

    def _unnormalised(self, image: torch.Tensor) -> torch.Tensor:
        """``[3, H, W]`` processed pixels -> the 0-255 values they were made from (float64)."""
        p = self.processor
        x = image.double()
        if getattr(p, "do_normalize", True) and p.image_mean is not None:
            mean = torch.tensor(p.image_mean, dtype=torch.float64).reshape(-1, 1, 1)
            std = torch.tensor(p.image_std, dtype=torch.float64).reshape(-1, 1, 1)
            x = x * std + mean
        if getattr(p, "do_rescale", True):
            x = x / float(p.rescale_factor)
        return x

    def _images(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        """Each picture's processed pixels as ``[3, H, W]`` (patches put back in place)."""
        pixels = inputs["pixel_values"].detach().cpu()
        if self.family == "gemma3":
            return list(pixels)
        p = self.processor
        if self.family in ("qwen3_5", "qwen3_5_moe"):  # the mixture of experts ships Qwen3.5's image processor
            m, t, size = int(p.merge_size), int(p.temporal_patch_size), int(p.patch_size)
            out, start = [], 0
            for _, gh, gw in inputs["image_grid_thw"].tolist():  # one frame per picture (grid_t 1)
                rows = pixels[start:start + gh * gw]
                start += gh * gw
                # (gh/m, gw/m, m, m, C, T, P, P), frame 0 of the T copies -> (C, gh/m, m, P, gw/m, m, P)
                x = rows.reshape(gh // m, gw // m, m, m, -1, t, size, size)[:, :, :, :, :, 0]
                out.append(x.permute(4, 0, 2, 5, 1, 3, 6).reshape(-1, gh * size, gw * size))
            return out
        size = int(p.patch_size)
        out = []
        for patches, positions in zip(pixels, inputs["image_position_ids"].cpu()):
            real = positions[:, 0] >= 0  # padding patches sit at -1
            patches, positions = patches[real], positions[real]
            pw, ph = int(positions[:, 0].max()) + 1, int(positions[:, 1].max()) + 1
            # (ph, pw, P, P, C) row-major patches -> (C, ph, P, pw, P)
            x = patches.reshape(ph, pw, size, size, -1).permute(4, 0, 2, 1, 3)
            out.append(x.reshape(-1, ph * size, pw * size))
        return out

    def request(self, tokens: Sequence[int], inputs: Optional[Mapping[str, torch.Tensor]],
                where: str) -> Tuple[List[int], List[Any]]:
        """``(tokens with one marker per picture, pictures)`` of one prompt (``inputs`` None: the tokens as they
        are, no pictures)."""
        if inputs is None:
            return [int(t) for t in tokens], []
        pictures = self.pictures(inputs, where)
        return self.collapse(tokens, len(pictures), where), pictures


def png_data_url(picture: Any) -> str:
    """A PIL picture as a ``data:image/png;base64,...`` URL (lossless: the server decodes the same 8-bit pixels)."""
    import base64
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
