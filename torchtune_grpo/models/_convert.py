"""Parameter names and layouts between a Hugging Face checkpoint and the torchtune decoder of
:func:`~torchtune_grpo.models.hf_model`.

One table for every supported architecture. For the ``interleaved`` layout (Llama, Mistral: torchtune's RoPE
rotates adjacent pairs, Hugging Face's rotates the two halves of a head) the q/k projection rows are permuted
on the way in and back on the way out, exactly as torchtune's own ``convert_weights.hf_to_tune`` does; the
``half`` layout (Qwen2, Qwen3) is Hugging Face's own and only renamed.
"""

import re
import warnings
from typing import Dict, Optional, Tuple

import torch

from torchtune_grpo.models._spec import HFModelSpec

__all__ = ["expected_hf_shapes", "hf_to_tune", "ignorable", "tune_to_hf", "tune_to_hf_param"]

_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.q_norm.weight": "attn.q_proj.norm.scale",
    "self_attn.k_norm.weight": "attn.k_proj.norm.scale",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TUNE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# HF rotary buffers some old checkpoints carry; never weights.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def ignorable(name: str, spec: HFModelSpec) -> bool:
    """Tensors a checkpoint may carry that are not weights of the model: rotary buffers, a tied lm_head."""
    return bool(_IGNORED.search(name)) or (spec.tie_word_embeddings and name == "lm_head.weight")


def _permuted(rope_order: str, tune_name: str) -> bool:
    return rope_order == "interleaved" and tune_name.endswith(("attn.q_proj.weight", "attn.k_proj.weight"))


def _to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    # [heads * head_dim, d]: each head's rows (first half, second half) -> (pair 0, pair 1, ...)
    heads = w.shape[0] // head_dim
    return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def _to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    heads = w.shape[0] // head_dim
    return w.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def hf_name_to_tune(name: str) -> str:
    """A Hugging Face parameter name -> torchtune's; KeyError for a name no supported model has."""
    if name in _TOP:
        return _TOP[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _LAYER:
        return f"layers.{match.group(1)}.{_LAYER[match.group(2)]}"
    raise KeyError(name)


def tune_name_to_hf(name: str) -> str:
    """A torchtune parameter name (of :func:`hf_model`'s decoder) -> Hugging Face's."""
    if name in _TOP_INV:
        return _TOP_INV[name]
    match = _TUNE_LAYER.match(name)
    if match and match.group(2) in _LAYER_INV:
        return f"model.layers.{match.group(1)}.{_LAYER_INV[match.group(2)]}"
    raise KeyError(name)


def hf_to_tune(state: Dict[str, torch.Tensor], spec: HFModelSpec, source: str = "checkpoint") -> Dict[str, torch.Tensor]:
    """Hugging Face state dict -> the torchtune decoder's.

    ``lm_head.weight`` of a tied model is dropped (the decoder reuses the embeddings).

    Raises:
        ValueError: for a tensor no parameter of the model corresponds to (named).
    """
    out = {}
    for name, tensor in state.items():
        if ignorable(name, spec):
            continue
        try:
            tune = hf_name_to_tune(name)
        except KeyError:
            raise ValueError(
                f"{source}: tensor {name!r} does not belong to a {spec.model_type} model as config.json "
                "describes it (see docs/models.md for the supported architectures)"
            ) from None
        out[tune] = _to_interleaved(tensor, spec.head_dim) if _permuted(spec.rope_order, tune) else tensor
    return out


def tune_to_hf_param(
    name: str, tensor: torch.Tensor, *, rope_order: Optional[str] = None, head_dim: int,
    rope_layout: Optional[str] = None,
) -> Tuple[str, torch.Tensor]:
    """One torchtune ``(name, tensor)`` -> Hugging Face's (streamed weight sync, saving).

    Args:
        name (str): torchtune parameter name.
        tensor (torch.Tensor): the full (unsharded) parameter.
        rope_order (Optional[str]): the order of RoPE's rotated pairs in q/k rows: ``"interleaved"`` (Llama,
            Mistral: q/k rows permuted back) or ``"half"`` (Qwen2, Qwen3: renamed only);
            ``SUPPORTED_MODEL_TYPES[model_type]``. Required.
        head_dim (int): per-head width.
        rope_layout (Optional[str]): the old name of ``rope_order`` (works until the next release, with a
            FutureWarning). Default is None.

    Raises:
        KeyError: for a name no supported model has.
        TypeError: without ``rope_order``.
    """
    if rope_layout is not None:
        warnings.warn("tune_to_hf_param(rope_layout=...) is now rope_order=...; the old keyword works until the "
                      "next release", FutureWarning, stacklevel=2)
        rope_order = rope_layout if rope_order is None else rope_order
    if rope_order is None:
        raise TypeError("tune_to_hf_param() needs rope_order ('interleaved' or 'half')")
    hf = tune_name_to_hf(name)
    return hf, (_to_halves(tensor, head_dim) if _permuted(rope_order, name) else tensor)


def tune_to_hf(state: Dict[str, torch.Tensor], spec: HFModelSpec) -> Dict[str, torch.Tensor]:
    """The torchtune decoder's state dict -> Hugging Face's (no ``lm_head.weight`` when tied)."""
    return dict(
        tune_to_hf_param(name, tensor, rope_order=spec.rope_order, head_dim=spec.head_dim)
        for name, tensor in state.items()
    )


def expected_hf_shapes(spec: HFModelSpec) -> Dict[str, Tuple[int, ...]]:
    """Every Hugging Face tensor name of the model ``spec`` describes, with its shape."""
    hd, dim, inter = spec.head_dim, spec.dim, spec.intermediate_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    layer = {
        "self_attn.q_proj.weight": (q, dim),
        "self_attn.k_proj.weight": (kv, dim),
        "self_attn.v_proj.weight": (kv, dim),
        "self_attn.o_proj.weight": (dim, q),
        "mlp.gate_proj.weight": (inter, dim),
        "mlp.up_proj.weight": (inter, dim),
        "mlp.down_proj.weight": (dim, inter),
        "input_layernorm.weight": (dim,),
        "post_attention_layernorm.weight": (dim,),
    }
    if spec.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if spec.qk_norm:
        layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, dim), "model.norm.weight": (dim,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, dim)
    for i in range(spec.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes
