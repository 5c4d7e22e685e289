"""Prompts with images: a question and one or more images per row, built with the model directory's processor.

Each item is ``{"tokens", "prompt", "answer", "image_inputs", "num_images", **other_columns}``: ``tokens`` the
prompt's ids with the family's image tokens expanded (one per image feature the tower will produce),
``image_inputs`` the processor's image tensors for the prompt (see :data:`PER_TOKEN_KEYS` for the per-token ones):

- Qwen3.5: ``pixel_values [patches, C*T*P*P]``, ``image_grid_thw [images, 3]``, ``mm_token_type_ids [L]``;
- Gemma 3: ``pixel_values [images, 3, H, W]``, ``token_type_ids [L]`` (1 on image tokens: attention among an
  image's tokens is bidirectional);
- Gemma 4: ``pixel_values [images, patches, 3*P*P]``, ``image_position_ids [images, patches, 2]``,
  ``mm_token_type_ids [L]``.

Rows name their images in ``image_column``: a path (or a list of paths) relative to the data file's folder for
JSON/JSONL/CSV files, or a Hugging Face ``datasets`` image column (``datasets.Image``: decoded images, or
``{"bytes", "path"}`` records). A row whose image is missing, unreadable or refused by the processor is dropped
and counted in one warning, or stops the run naming the row and the image (``on_invalid_row``), as the text
builders treat empty questions and answers.
"""

import io
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from torch.utils.data import Dataset

from torchtune_grpo.data._rows import check_on_invalid_row, describe_source, InvalidRows
from torchtune_grpo.data._verifiable import load_rows, require_columns

__all__ = ["image_dataset", "ImagePromptDataset", "PER_TOKEN_KEYS"]

log = logging.getLogger(__name__)

#: ``image_inputs`` keys with one value per prompt token (stored as ``[L]``; the others are per image).
PER_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")


class _BadImage(Exception):
    """A row's image that cannot be used; ``reason`` is ``missing``, ``unreadable``, ``refused`` or ``mismatched``
    (not as many as the question's image placeholders)."""

    def __init__(self, reason: str, image: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.image, self.detail = reason, image, detail


def _names(values: List[Any]) -> str:
    """A row's image cells for a message: each path (a decoded-on-demand cell's ``path``), 200 characters at most."""
    return ", ".join(str(v.get("path") if isinstance(v, dict) else v)[:200] for v in values)


def _at_placeholders(question: str, marker: str, values: List[Any]) -> List[Dict[str, Any]]:
    """The user turn's content: ``question``'s text with an image part where each ``marker`` stood."""
    pieces = question.split(marker)
    if len(pieces) - 1 != len(values):
        raise _BadImage("mismatched", _names(values),
                        f"the question has {len(pieces) - 1} {marker!r} marker(s) for {len(values)} image(s)")
    content: List[Dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i:
            content.append({"type": "image"})
        if piece.strip():  # nothing for the empty text before a leading marker (or between two markers)
            content.append({"type": "text", "text": piece.strip()})
    return content


def _open(value: Any, root: Optional[str]):
    """A PIL RGB image from a path (relative to ``root``), a ``datasets`` image record, or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and value.get("bytes") is not None:
        name = value.get("path") or "<bytes>"
        try:
            return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
        except (UnidentifiedImageError, OSError) as err:
            raise _BadImage("unreadable", name, f"{type(err).__name__}: {err}") from err
    if isinstance(value, dict):
        value = value.get("path")
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise _BadImage("missing", repr(value), "no image path")
    path = os.path.join(root, value) if root and not os.path.isabs(value) else os.fspath(value)
    if not os.path.isfile(path):
        raise _BadImage("missing", path, "no such file")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # decodes now: a truncated file fails here, not in the processor
    except (UnidentifiedImageError, OSError) as err:
        raise _BadImage("unreadable", path, f"{type(err).__name__}: {err}") from err


def _image_root(source: str, data_files: Any, image_root: Optional[str]) -> Optional[str]:
    """Where relative image paths start: ``image_root``, else the one folder all local data files are in."""
    if image_root is not None:
        return image_root
    from torchtune_grpo.data._files import local_data_files

    folders = {os.path.dirname(os.path.abspath(f)) for f in local_data_files(source, data_files)}
    if len(folders) > 1:
        raise ValueError(f"data files in {len(folders)} folders ({sorted(folders)}): relative image paths are "
                         "ambiguous; set image_root")
    return folders.pop() if folders else (source if os.path.isdir(source) else None)


def _undecoded(rows, column: str):
    """``rows`` with a ``datasets`` image column left as ``{"bytes", "path"}`` records: decoded here, row by row,
    so that an unreadable image drops its row instead of failing the iteration."""
    from datasets import Image, Sequence as DatasetsSequence

    feature = getattr(rows, "features", {}).get(column)
    if isinstance(feature, Image):
        return rows.cast_column(column, Image(decode=False))
    if isinstance(feature, DatasetsSequence) and isinstance(feature.feature, Image):
        return rows.cast_column(column, DatasetsSequence(Image(decode=False)))
    if isinstance(feature, list) and feature and isinstance(feature[0], Image):
        return rows.cast_column(column, [Image(decode=False)])
    return rows


class ImagePromptDataset(Dataset):
    """Image prompts, processed once (see the module docstring).

    Args:
        rows: the rows (a ``datasets.Dataset`` or a list of dicts).
        processor (Any): :func:`~torchtune_grpo.data._image_processor.load_image_processor`'s processor.
        question_column (str): the question's column.
        answer_column (str): the gold answer's column.
        image_column (str): the image column (see the module docstring).
        image_root (Optional[str]): the folder relative image paths start from.
        system_prompt (Optional[str]): a system message before the question. Default is None.
        max_prompt_length (Optional[int]): prompts with more tokens (image tokens included) are dropped.
        source_name (str): the dataset, for messages.
        image_placeholder (Optional[str]): a marker in the question text where the row's images go, in order
            (Geometry3K's ``<image>``): the marker is removed and each image placed where it stood; a row whose
            markers do not match its images is invalid (``mismatched``). None: the images go ahead of the
            question. Default is None.
        on_invalid_row (str): ``"drop"`` or ``"error"``.

    Raises:
        ValueError: a row with a bad image or blank question/answer under ``on_invalid_row="error"`` (naming the
            row and the image), or no prompt left.
    """

    def __init__(self, rows, processor: Any, *, question_column: str, answer_column: str, image_column: str,
                 image_root: Optional[str], system_prompt: Optional[str] = None,
                 max_prompt_length: Optional[int] = None, source_name: str = "dataset",
                 on_invalid_row: str = "drop", image_placeholder: Optional[str] = None) -> None:
        check_on_invalid_row(on_invalid_row)
        invalid = InvalidRows(on_invalid_row, source_name)
        self.bad_images: Dict[str, int] = {}
        self._samples: List[Dict[str, Any]] = []
        num_rows = too_long = 0
        for index, row in enumerate(rows):
            num_rows += 1
            if invalid.skip(row, index, [question_column, answer_column, image_column]):
                continue
            try:
                sample = self._process(row, processor, question_column, image_column, image_root, system_prompt,
                                       image_placeholder)
            except _BadImage as bad:
                if on_invalid_row == "error":
                    raise ValueError(
                        f"row {index} (0-based) of {source_name}: image {bad.image} is {bad.reason} "
                        f"({bad.detail}); fix the data, or set on_invalid_row: drop to skip such rows") from bad
                self.bad_images[bad.reason] = self.bad_images.get(bad.reason, 0) + 1
                continue
            if max_prompt_length is not None and len(sample["tokens"]) > max_prompt_length:
                too_long += 1
                continue
            sample.update({k: v for k, v in row.items() if k not in (image_column, "tokens", "prompt")})
            sample["answer"] = str(row[answer_column]).strip()
            self._samples.append(sample)
        invalid.report(num_rows)
        self.num_rows, self.num_invalid, self.num_dropped = num_rows, invalid.num_dropped, too_long
        if self.bad_images:
            detail = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.bad_images.items()))
            log.warning(f"dropped {sum(self.bad_images.values())} of {num_rows} rows of {source_name} with an image "
                        f"that could not be used ({detail}); on_invalid_row: error refuses them instead")
        if too_long:
            log.warning(f"dropped {too_long} of {num_rows} prompts longer than max_prompt_length={max_prompt_length} "
                        "tokens (image tokens included)")
        if not self._samples:
            raise ValueError(
                f"no prompts left from {source_name}: of {num_rows} rows, {too_long} longer than max_prompt_length="
                f"{max_prompt_length} tokens (image tokens included), {sum(self.bad_images.values())} with an image "
                f"that could not be used, {invalid.num_dropped} with an empty or null value" if num_rows
                else f"{source_name} has no rows")

    @staticmethod
    def _process(row, processor, question_column, image_column, image_root, system_prompt,
                 image_placeholder: Optional[str] = None) -> Dict[str, Any]:
        value = row[image_column]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        images = [_open(v, image_root) for v in values]
        question = str(row[question_column])
        if image_placeholder is None:
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        else:
            content = _at_placeholders(question, image_placeholder, values)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": content}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        try:
            out = processor(text=[text], images=[images], return_tensors="pt")
        except Exception as err:  # noqa: BLE001 - the processor's own refusal (size, mode, count), reported by row
            raise _BadImage("refused", _names(values), f"{type(err).__name__}: {err}") from err
        tokens = out["input_ids"][0].tolist()
        inputs = {k: (v[0] if k in PER_TOKEN_KEYS else v) for k, v in out.items()
                  if k not in ("input_ids", "attention_mask")}
        return {"tokens": tokens, "prompt": text, "image_inputs": inputs, "num_images": len(images)}

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        out = dict(self._samples[index])
        out["tokens"] = list(out["tokens"])
        return out


def image_dataset(
    tokenizer,
    source: str,
    *,
    question_column: str = "question",
    answer_column: str = "answer",
    image_column: str = "image",
    split: str = "train",
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    name: Optional[str] = None,
    image_root: Optional[str] = None,
    model_dir: Optional[str] = None,
    system_prompt: Optional[str] = None,
    max_prompt_length: Optional[int] = 1024,
    on_invalid_row: str = "drop",
    image_placeholder: Optional[str] = None,
    **load_dataset_kwargs,
) -> ImagePromptDataset:
    """Prompt dataset of questions about images, built with the model directory's processor.

    Example YAML::

        dataset:
          _component_: torchtune_grpo.data.image_dataset
          source: json
          data_files: /data/shapes/train.jsonl   # {"image": "img/0.png", "question": "...", "answer": "circle"}
          image_column: image                    # a path, or a list of paths, relative to the file's folder

    Args:
        tokenizer: the recipe's tokenizer; its ``path`` is the model directory unless ``model_dir`` is given.
        source (str): hub name, local dataset directory, or ``"json"``/``"csv"``/``"parquet"`` with ``data_files``.
        question_column (str): the question's column. Default is ``"question"``.
        answer_column (str): the gold answer's column. Default is ``"answer"``.
        image_column (str): the image column: paths or a ``datasets`` image column. Default is ``"image"``.
        split (str): split to load. Default is ``"train"``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        name (Optional[str]): dataset config name. Default is None.
        image_root (Optional[str]): the folder relative image paths start from. Default is None: the data files'
            folder (a local dataset directory: itself).
        model_dir (Optional[str]): the model directory whose processor builds the prompts. Default is None:
            ``tokenizer.path``.
        system_prompt (Optional[str]): a system message before the question. Default is None.
        max_prompt_length (Optional[int]): longer prompts (image tokens included) are dropped. Default is 1024.
        on_invalid_row (str): a row with an empty question/answer/image, or an image that is missing, unreadable
            or refused by the processor, is dropped (``"drop"``, counted in one warning) or refused (``"error"``,
            naming the row and the image). Default is ``"drop"``.
        image_placeholder (Optional[str]): a marker in the question where the images go, in order (e.g.
            ``"<image>"``): removed from the text, each image placed where it stood; a row with as many markers as
            images only (else invalid). Default is None: the images go ahead of the question.
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        ImagePromptDataset: the prompts.

    Raises:
        ValueError: a missing column, no model directory, or a bad row under ``on_invalid_row="error"``.
    """
    from torchtune_grpo.data._image_processor import load_image_processor

    check_on_invalid_row(on_invalid_row)
    model_dir = model_dir or getattr(tokenizer, "path", None)
    if model_dir is None:
        raise ValueError("image_dataset needs the model directory (its processor builds the prompts): set model_dir")
    rows = load_rows(source, name=name, split=split, data_files=data_files, **load_dataset_kwargs)
    require_columns(rows, [question_column, answer_column, image_column], source)
    rows = _undecoded(rows, image_column)
    return ImagePromptDataset(
        rows, load_image_processor(model_dir), question_column=question_column, answer_column=answer_column,
        image_column=image_column, image_root=_image_root(source, data_files, image_root),
        system_prompt=system_prompt, max_prompt_length=max_prompt_length,
        source_name=describe_source(source, split, data_files), on_invalid_row=on_invalid_row,
        image_placeholder=image_placeholder)
