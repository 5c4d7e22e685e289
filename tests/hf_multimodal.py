"""Tiny random checkpoints that are multimodal on disk, as the real Qwen3.5, Gemma 3 (4B and larger) and Gemma 4
checkpoints are, made by transformers' own full classes (``AutoModelForImageTextToText.from_config`` on a config
with a ``text_config`` (the matching :mod:`tests.hf_families` text family, peaked attention, same tokenizer
and chat template) and a one-layer ``vision_config`` (Gemma 4: and ``audio_config``)).

``make_multimodal_dir(family, directory, seed=0, max_shard_size=None)`` for ``family`` in
:data:`MULTIMODAL_FAMILIES`; :data:`LANGUAGE_PREFIX` gives the on-disk prefix of the language model's tensors.

What is on disk and what transformers 5.19 does with it (measured on these fixtures, fp32, by
``tests/test_hf_families.py`` and the survey that wrote this docstring):

``qwen3_5`` (``Qwen3_5ForConditionalGeneration``; tied as default, ``tie_word_embeddings=False`` for the larger
untied ones):
    on disk: ``model.language_model.{embed_tokens,layers.N.*,norm}.*``, ``model.visual.*`` (the tower, with
    ``model.visual.merger.*`` its projector), ``lm_head.weight`` only when untied, and, as the Hub files have
    them, ``mtp.*`` (the multi-token-prediction head: ``mtp.fc.weight``,
    ``mtp.pre_fc_norm_{embedding,hidden}.weight``, ``mtp.norm.weight``; written by this module after
    ``save_pretrained``, transformers has no module for them).
    ``AutoModelForImageTextToText``: the full class, in memory under the on-disk names (plus ``lm_head.weight``,
    tied); ``mtp.*`` are dropped silently (not even reported as unexpected keys); ``save_pretrained`` writes the
    on-disk names again, without ``mtp.*``.
    ``AutoModelForCausalLM``: ``Qwen3_5ForCausalLM``, the text-only class: ``model.language_model.X`` is
    ``model.X`` in memory, ``model.visual.*`` and ``mtp.*`` are dropped silently; its ``save_pretrained`` writes
    ``model.language_model.*`` again (the language tensors only: the towers are lost).
``gemma3`` (``Gemma3ForConditionalGeneration``; SigLIP tower without head, as Gemma 3 4B+; tied):
    on disk, as the Hub files (the transformers-4 layout): ``language_model.model.*``,
    ``vision_tower.vision_model.*``, ``multi_modal_projector.{mm_input_projection_weight,
    mm_soft_emb_norm.weight}``, no ``lm_head.weight``.
    ``AutoModelForImageTextToText`` and ``AutoModelForCausalLM`` alike give the full class (towers kept), in
    memory ``model.language_model.*``, ``model.vision_tower.*`` (WITHOUT ``vision_model.``),
    ``model.multi_modal_projector.*``, ``lm_head.weight`` (tied). ``save_pretrained`` of a model so loaded
    writes the Hub names back exactly; of a model made with ``from_config`` it writes ``language_model.model.*``
    and ``multi_modal_projector.*`` but ``vision_tower.*`` without ``vision_model.`` (the on-disk names depend on
    where the model came from: carry the source's names, never re-derive them).
``gemma4`` (``Gemma4ForConditionalGeneration``; vision and audio towers, as Gemma 4 E2B/E4B; tied):
    on disk = in memory (released with transformers 5): ``model.language_model.*`` (with
    ``embed_tokens_per_layer``, ``per_layer_model_projection``, ``per_layer_projection_norm``),
    ``model.vision_tower.*``, ``model.embed_vision.*``, ``model.audio_tower.*``, ``model.embed_audio.*``,
    no ``lm_head.weight``. ``AutoModelForCausalLM`` gives the full class (towers kept), as for Gemma 3;
    ``save_pretrained`` writes the same names.

In all three the full class's text-only logits equal (bit for bit, fp32) those of ``AutoModelForCausalLM``'s
model and of the text class loaded as below.

Loading only the language model by its on-disk names: take the tensors whose names start with
``LANGUAGE_PREFIX[family]`` (``safetensors.safe_open``, per shard of ``model.safetensors.index.json``), strip
the prefix, and load them into the text class built from ``config.text_config``
(``AutoModelForCausalLM.from_config(config.text_config)``: ``Qwen3_5ForCausalLM``, ``Gemma3ForCausalLM``,
``Gemma4ForCausalLM``) under ``"model." + rest``, plus ``lm_head.weight`` (a top-level name in all three) when
the head is untied (tied: call ``tie_weights()``). Every other tensor (towers, projectors, ``mtp.*``) can be
copied byte-for-byte from the source files under its own name. :func:`language_state_dict` does the first.
"""

import json
from pathlib import Path
from typing import Dict, Optional

import torch

from tests.hf_families import family_config, make_tokenizer, scale_routers, sharpen, write_tokenizer_files

__all__ = ["LANGUAGE_PREFIX", "MULTIMODAL_FAMILIES", "TEXT_FAMILY", "language_state_dict", "make_multimodal_dir",
           "multimodal_config"]

MULTIMODAL_FAMILIES = ("qwen3_5", "gemma3", "gemma4")
# Qwen3.5-MoE: the Qwen3.5 layout with a mixture-of-experts language model (tests/hf_moe.py).
TEXT_FAMILY = {"qwen3_5": "qwen3_5_text", "gemma3": "gemma3_text", "gemma4": "gemma4_text",
               "qwen3_5_moe": "qwen3_5_moe_text"}
LANGUAGE_PREFIX = {"qwen3_5": "model.language_model.", "qwen3_5_moe": "model.language_model.",
                   "gemma3": "language_model.model.", "gemma4": "model.language_model."}


def multimodal_config(family: str, **text_overrides):
    """The full (text + vision (+ audio)) transformers config of ``family``'s tiny multimodal checkpoint;
    ``text_overrides`` change its ``text_config`` (e.g. ``tie_word_embeddings=False``)."""
    from transformers import AutoConfig

    text_family = TEXT_FAMILY[family]
    text = family_config(text_family, **text_overrides).to_dict()
    i = make_tokenizer(text_family).token_to_id
    if family in ("qwen3_5", "qwen3_5_moe"):
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=16)
        return AutoConfig.for_model(
            family, text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
            image_token_id=i("<|image_pad|>"), video_token_id=i("<|video_pad|>"),
            vision_start_token_id=i("<|vision_start|>"), vision_end_token_id=i("<|vision_end|>"))
    if family == "gemma3":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=16, patch_size=4, vision_use_head=False)
        return AutoConfig.for_model(
            "gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
            boi_token_index=i("<start_of_image>"), eoi_token_index=i("<end_of_image>"),
            image_token_index=i("<image_soft_token>"))
    if family == "gemma4":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
                      pooling_kernel_size=2)
        audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                     conv_kernel_size=3, output_proj_dims=32, attention_chunk_size=4, attention_context_left=5)
        return AutoConfig.for_model(
            "gemma4", text_config=text, vision_config=vision, audio_config=audio,
            boi_token_id=i("<|image>"), eoi_token_id=i("<image|>"), image_token_id=i("<|image|>"),
            video_token_id=i("<|video|>"), boa_token_id=i("<|audio>"), eoa_token_index=i("<audio|>"),
            audio_token_id=i("<|audio|>"))
    raise ValueError(f"unknown multimodal family {family!r}; known: {', '.join(MULTIMODAL_FAMILIES)}")


def _hub_layout(family: str, tensors: Dict[str, torch.Tensor], seed: int, last: bool) -> Dict[str, torch.Tensor]:
    """The names of the real checkpoints where ``save_pretrained`` writes others, and (in the ``last`` shard)
    the tensors they have that transformers does not."""
    if family == "gemma3":  # the Hub files keep SigLIP's own vision_model level
        return {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
                for k, v in tensors.items()}
    if family in ("qwen3_5", "qwen3_5_moe") and last:  # the Hub files' multi-token-prediction head (transformers: none)
        gen = torch.Generator().manual_seed(seed + 2)
        norm = tensors["model.language_model.norm.weight"]
        hidden = norm.shape[0]
        extra = {"mtp.fc.weight": 0.08 * torch.randn(hidden, 2 * hidden, generator=gen),
                 "mtp.pre_fc_norm_embedding.weight": 0.3 * torch.randn(hidden, generator=gen),
                 "mtp.pre_fc_norm_hidden.weight": 0.3 * torch.randn(hidden, generator=gen),
                 "mtp.norm.weight": 0.3 * torch.randn(hidden, generator=gen)}
        return {**tensors, **{k: v.to(norm.dtype) for k, v in extra.items()}}
    return tensors


def make_multimodal_dir(family: str, directory, *, seed: int = 0, max_shard_size: Optional[str] = None,
                        peaked: bool = True, router_gain: float = 1.0, dtype: torch.dtype = torch.float32,
                        **text_overrides) -> Path:
    """Write ``family``'s tiny multimodal checkpoint to ``directory``, with the text family's tokenizer files.

    Args:
        family (str): ``qwen3_5``, ``gemma3``, ``gemma4`` or ``qwen3_5_moe``.
        directory: where to write (created if needed).
        seed (int): the weights' seed; the same seed gives byte-identical files. Default is 0.
        max_shard_size (Optional[str]): shard the weights (e.g. ``"100KB"``) with a
            ``model.safetensors.index.json``, as the real checkpoints are. Default is None (one file).
        peaked (bool): sharpen the language model's attention (:func:`tests.hf_families.sharpen`). Default is True.
        router_gain (float): the factor on a mixture of experts' router weights
            (:func:`tests.hf_families.scale_routers`). Default is 1.0.
        dtype (torch.dtype): the weights' dtype on disk. Default is ``torch.float32``.
        **text_overrides: fields of the ``text_config`` (``tie_word_embeddings=False``: Qwen3.5 9B-style
            untied head, written as ``lm_head.weight``).

    Returns:
        Path: ``directory``.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from tests.hf_models import randomize

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(multimodal_config(family, **text_overrides), dtype=torch.float32)
    randomize(model, seed)
    if peaked:
        sharpen(model.model.language_model, TEXT_FAMILY[family], seed)
    scale_routers(model, router_gain)
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    index_file = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index_file.read_text())["weight_map"].values())) if index_file.is_file() else [
        "model.safetensors"]
    weight_map = {}
    for n, name in enumerate(files):
        tensors = _hub_layout(family, load_file(directory / name), seed, last=n == len(files) - 1)
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(TEXT_FAMILY[family], directory)
    return directory


def language_state_dict(family: str, directory) -> Dict[str, torch.Tensor]:
    """The language model's tensors of a multimodal directory, read by their on-disk names and renamed for
    the text class (``AutoModelForCausalLM.from_config(config.text_config)``): ``PREFIX + rest`` ->
    ``"model." + rest``, and ``lm_head.weight`` when the checkpoint has one (untied)."""
    from safetensors import safe_open

    directory = Path(directory)
    index_file = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index_file.read_text())["weight_map"].values())) if index_file.is_file() else [
        "model.safetensors"]
    prefix, out = LANGUAGE_PREFIX[family], {}
    for name in files:
        with safe_open(directory / name, "pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out["model." + key[len(prefix):]] = f.get_tensor(key)
                elif key == "lm_head.weight":
                    out[key] = f.get_tensor(key)
    return out
