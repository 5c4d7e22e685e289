"""torchtune decoders built from a Hugging Face model directory's ``config.json``.

The decoder is made of torchtune's own modules (``TransformerDecoder``, ``MultiHeadAttention``, ``FeedForward``,
``RMSNorm``, ``TiedLinear``, ``LoRALinear`` and its RoPE classes), named as torchtune's builders name them, so
everything downstream (FSDP2 sharding, activation checkpointing, LoRA utilities, the generation engines) treats
it as any torchtune model.

Qwen3 normalises each query and key head with an RMSNorm *before* RoPE. torchtune 0.6.1's
``MultiHeadAttention`` applies its ``q_norm``/``k_norm`` *after* RoPE, which is a different model (a per-channel
scale does not commute with the rotation). Here the norm is part of the projection instead
(:class:`HeadNormLinear`, :class:`HeadNormLoRALinear`): ``q_proj(x)`` returns normalised heads, so every code path
that calls ``q_proj`` (torchtune's attention, this package's cached and shared-prompt forwards) computes Qwen3.
"""

from functools import partial
from pathlib import Path
from typing import List, Optional

import torch
from torch import nn
from torchtune.models.llama3_1 import Llama3ScaledRoPE
from torchtune.models.qwen2 import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import LoRALinear

from torchtune_grpo.models._backend import choose_backend
from torchtune_grpo.models._spec import HFModelSpec, read_hf_config
from torchtune_grpo.models._transformers_lora import add_lora
from torchtune_grpo.models._transformers_policy import build_transformers_decoder, text_model_config

__all__ = ["HeadNormLinear", "HeadNormLoRALinear", "LORA_TARGETS", "hf_model", "lora_hf_model"]

# Module names LoRA may adapt (torchtune's names; the PEFT export maps them to Hugging Face's).
LORA_ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj")
LORA_TARGETS = LORA_ATTN_TARGETS + ("w1", "w2", "w3", "output")


def _head_rms_norm(norm: RMSNorm, y: torch.Tensor, head_dim: int) -> torch.Tensor:
    # [..., heads * head_dim] -> per-head RMSNorm -> [..., heads * head_dim]
    return norm(y.unflatten(-1, (-1, head_dim))).flatten(-2)


class HeadNormLinear(nn.Linear):
    """A bias-free projection followed by an RMSNorm of each ``head_dim`` slice (Qwen3's q/k norm).

    Args:
        in_dim (int): input width.
        out_dim (int): output width, a multiple of ``head_dim``.
        head_dim (int): width of one head.
        eps (float): RMSNorm epsilon.
    """

    def __init__(self, in_dim: int, out_dim: int, head_dim: int, eps: float) -> None:
        super().__init__(in_dim, out_dim, bias=False)
        self.head_dim = head_dim
        self.norm = RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_dim]`` -> ``[..., out_dim]``, each head normalised."""
        return _head_rms_norm(self.norm, super().forward(x), self.head_dim)


class HeadNormLoRALinear(LoRALinear):
    """:class:`~torchtune.modules.peft.LoRALinear` followed by an RMSNorm of each head (Qwen3 with LoRA).

    The norm acts on the adapted projection's output, as in the merged model. Arguments are LoRALinear's plus
    ``head_dim`` and ``eps``.
    """

    def __init__(self, in_dim: int, out_dim: int, head_dim: int, eps: float, **lora_kwargs) -> None:
        super().__init__(in_dim, out_dim, **lora_kwargs)
        self.head_dim = head_dim
        self.norm = RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_dim]`` -> ``[..., out_dim]``, each head normalised."""
        return _head_rms_norm(self.norm, super().forward(x), self.head_dim)


class _LoRASettings:
    def __init__(self, targets: List[str], rank: int, alpha: float, dropout: float, quantize_base: bool):
        self.targets, self.rank, self.alpha = set(targets), rank, alpha
        self.dropout, self.quantize_base = dropout, quantize_base


def _linear(
    name: str, in_dim: int, out_dim: int, *, bias: bool, lora: Optional[_LoRASettings],
    head_norm: Optional[tuple] = None,
) -> nn.Module:
    """A projection: plain, with LoRA when ``name`` is a LoRA target, and/or with a per-head norm."""
    if lora is not None and name in lora.targets:
        kwargs = dict(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, use_bias=bias,
                      quantize_base=lora.quantize_base)
        if head_norm is not None:
            return HeadNormLoRALinear(in_dim, out_dim, *head_norm, **kwargs)
        return LoRALinear(in_dim, out_dim, **kwargs)
    if head_norm is not None:
        return HeadNormLinear(in_dim, out_dim, *head_norm)
    return nn.Linear(in_dim, out_dim, bias=bias)


def _rope(spec: HFModelSpec) -> nn.Module:
    if spec.rope_order == "half":
        return Qwen2RotaryPositionalEmbeddings(spec.head_dim, max_seq_len=spec.max_seq_len, base=spec.rope_base)
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        return Llama3ScaledRoPE(
            spec.head_dim, max_seq_len=spec.max_seq_len, base=spec.rope_base, scale_factor=s.factor,
            low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
            old_context_len=s.original_max_position_embeddings,
        )
    return RotaryPositionalEmbeddings(spec.head_dim, max_seq_len=spec.max_seq_len, base=spec.rope_base)


def build_decoder(spec: HFModelSpec, lora: Optional[_LoRASettings] = None) -> TransformerDecoder:
    """The torchtune decoder of ``spec`` (randomly initialised; the checkpointer loads the weights)."""
    rope = _rope(spec)  # one module shared by all layers, as in torchtune's builders
    hd, dim = spec.head_dim, spec.dim
    head_norm = (hd, spec.norm_eps) if spec.qk_norm else None
    layers = []
    for _ in range(spec.num_layers):
        attn = MultiHeadAttention(
            embed_dim=dim,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=hd,
            q_proj=_linear("q_proj", dim, spec.num_heads * hd, bias=spec.qkv_bias, lora=lora, head_norm=head_norm),
            k_proj=_linear("k_proj", dim, spec.num_kv_heads * hd, bias=spec.qkv_bias, lora=lora, head_norm=head_norm),
            v_proj=_linear("v_proj", dim, spec.num_kv_heads * hd, bias=spec.qkv_bias, lora=lora),
            output_proj=_linear("output_proj", spec.num_heads * hd, dim, bias=False, lora=lora),
            pos_embeddings=rope,
            max_seq_len=spec.max_seq_len,
            attn_dropout=spec.attn_dropout,
        )
        mlp = FeedForward(
            gate_proj=_linear("w1", dim, spec.intermediate_dim, bias=False, lora=lora),
            down_proj=_linear("w2", spec.intermediate_dim, dim, bias=False, lora=lora),
            up_proj=_linear("w3", dim, spec.intermediate_dim, bias=False, lora=lora),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=RMSNorm(dim, eps=spec.norm_eps),
                mlp_norm=RMSNorm(dim, eps=spec.norm_eps),
            )
        )
    tok_embeddings = nn.Embedding(spec.vocab_size, dim)
    if spec.tie_word_embeddings:
        if lora is not None and "output" in lora.targets:
            raise ValueError(
                "apply_lora_to_output: the model ties its output projection to the embeddings "
                "(tie_word_embeddings: true in config.json), so it has no separate output layer to adapt"
            )
        output = TiedLinear(tok_embeddings)
    else:
        output = _linear("output", dim, spec.vocab_size, bias=False, lora=lora)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=spec.max_seq_len,
        num_heads=spec.num_heads,
        head_dim=hd,
        norm=RMSNorm(dim, eps=spec.norm_eps),
        output=output,
    )


# NF4 (torchao's defaults, which torchtune's LoRALinear uses): blocks of 64 values, their scales in groups of 256.
NF4_MULTIPLE = 64 * 256


def _check_nf4_sizes(spec: HFModelSpec, targets: List[str], path: str) -> None:
    """Raise a ValueError naming every adapted weight NF4 cannot quantise (torchao only asserts on counts)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {"q_proj": (q, spec.dim), "k_proj": (kv, spec.dim), "v_proj": (kv, spec.dim),
              "output_proj": (spec.dim, q), "w1": (spec.intermediate_dim, spec.dim),
              "w2": (spec.dim, spec.intermediate_dim), "w3": (spec.intermediate_dim, spec.dim),
              "output": (spec.vocab_size, spec.dim)}
    if spec.tie_word_embeddings:
        del shapes["output"]  # no output layer of its own (build_decoder refuses to adapt it)
    bad = [f"{name} ({rows} x {cols} = {rows * cols:,} values)" for name in targets if name in shapes
           for rows, cols in [shapes[name]] if (rows * cols) % NF4_MULTIPLE]
    if bad:
        raise ValueError(
            f"quantize_base: NF4 stores weights in blocks of 64 values with scales in groups of 256, so each "
            f"adapted weight must hold a multiple of {NF4_MULTIPLE:,} values; not so in the model of "
            f"{path}/config.json: {', '.join(bad)}. Leave those layers out of LoRA, or set quantize_base: False."
        )


def hf_model(
    path: str, max_seq_len: Optional[int] = None, backend: str = "auto", attn_implementation: Optional[str] = None,
) -> nn.Module:
    """The policy module of a Hugging Face model directory, built from torchtune's modules or transformers' own.

    Reads only the directory's ``config.json``; the weights are loaded by
    :class:`~torchtune_grpo.models.HFCheckpointer` from the same directory. See docs/models.md for which
    backend serves which architecture.

    Args:
        path (str): the model directory (``tune download <repo> --output-dir <path>``).
        max_seq_len (Optional[int]): build for at most this many positions (smaller RoPE and attention
            buffers). Default is None (the config's ``max_position_embeddings``).
        backend (str): ``"auto"`` (torchtune's modules for Llama 3.x / SmolLM2, Mistral without a window that
            bites, Qwen2/2.5, Qwen3 dense; transformers' ``AutoModelForCausalLM`` for every other causal LM),
            ``"torchtune"`` or ``"transformers"``. Default is ``"auto"``.
        attn_implementation (Optional[str]): the transformers backend's attention (``"sdpa"``, ``"eager"``, ...);
            None: transformers' default for the family. Default is None.

    Returns:
        nn.Module: a torchtune ``TransformerDecoder``, or a
        :class:`~torchtune_grpo.models.TransformersDecoder` (parameters on the meta device).

    Raises:
        FileNotFoundError: without ``config.json``.
        ValueError: for an architecture or config field that is not supported (the message names it).
    """
    hf_config = read_hf_config(path)
    chosen = choose_backend(hf_config, backend, source=str(Path(path) / "config.json"))
    if chosen.name == "torchtune":
        if attn_implementation is not None:
            raise ValueError("model.attn_implementation is for the transformers backend; this model is built "
                             f"from torchtune's modules ({chosen.reason})")
        return build_decoder(HFModelSpec.from_directory(path, max_seq_len=max_seq_len))
    return build_transformers_decoder(
        text_model_config(path), max_seq_len=max_seq_len, attn_implementation=attn_implementation,
        reason=chosen.reason,
    )


def lora_hf_model(
    path: str,
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = False,
    max_seq_len: Optional[int] = None,
    backend: str = "auto",
    attn_implementation: Optional[str] = None,
) -> nn.Module:
    """:func:`hf_model` with LoRA adapters (Hu et al. 2021, arXiv:2106.09685), for the LoRA recipe.

    Args:
        path (str): the model directory.
        lora_attn_modules (List[str]): attention projections to adapt, any of ``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): also adapt the MLP (``w1``, ``w2``, ``w3``). Default is False.
        apply_lora_to_output (bool): also adapt the output projection (untied models only). Default is False.
        lora_rank (int): rank r. Default is 8.
        lora_alpha (float): alpha (updates scaled by alpha / r). Default is 16.
        lora_dropout (float): dropout on the adapter input. Default is 0.0.
        quantize_base (bool): QLoRA (Dettmers et al. 2023, arXiv:2305.14314): NF4 base weights in the adapted
            layers; layers without an adapter keep the training dtype. ``state_dict()`` returns them
            dequantised (torchtune's QLoRA builders do the same). NF4 quantises blocks of 64 values in groups
            of 256 blocks, so each adapted weight's size must be a multiple of 16,384. Default is False.
        max_seq_len (Optional[int]): as in :func:`hf_model`. Default is None.
        backend (str): as in :func:`hf_model`. With transformers' module, ``lora_attn_modules`` and the MLP
            targets map to the family's own layers (``o_proj``, ``gate_proj``, a fused ``qkv_proj``, ...), or
            name them directly (:mod:`~torchtune_grpo.models._transformers_lora`). Default is ``"auto"``.
        attn_implementation (Optional[str]): as in :func:`hf_model`. Default is None.

    Returns:
        nn.Module: the model with ``LoRALinear`` layers.

    Raises:
        ValueError: for an unknown module name, an adapted weight NF4 cannot quantise (with
            ``quantize_base``; the message names it), or as :func:`hf_model`.
    """
    hf_config = read_hf_config(path)
    chosen = choose_backend(hf_config, backend, source=str(Path(path) / "config.json"))
    if chosen.name == "transformers":
        model = build_transformers_decoder(
            text_model_config(path), max_seq_len=max_seq_len, attn_implementation=attn_implementation,
            reason=chosen.reason,
        )
        targets = list(lora_attn_modules) + (["w1", "w2", "w3"] if apply_lora_to_mlp else [])
        targets += ["output"] if apply_lora_to_output else []
        add_lora(model, targets, rank=int(lora_rank), alpha=float(lora_alpha), dropout=float(lora_dropout),
                 quantize_base=bool(quantize_base))
        if quantize_base:
            model.register_state_dict_post_hook(partial(
                reparametrize_as_dtype_state_dict_post_hook, dtype=model.tok_embeddings.weight.dtype,
                offload_to_cpu=True,
            ))
        return model
    unknown = sorted(set(lora_attn_modules) - set(LORA_ATTN_TARGETS))
    if unknown:
        raise ValueError(f"lora_attn_modules: unknown {unknown}; choose from {list(LORA_ATTN_TARGETS)}")
    targets = list(lora_attn_modules) + (["w1", "w2", "w3"] if apply_lora_to_mlp else [])
    targets += ["output"] if apply_lora_to_output else []
    lora = _LoRASettings(targets, int(lora_rank), float(lora_alpha), float(lora_dropout), bool(quantize_base))
    spec = HFModelSpec.from_directory(path, max_seq_len=max_seq_len)
    if lora.quantize_base:
        _check_nf4_sizes(spec, targets, path)
    model = build_decoder(spec, lora)
    if lora.quantize_base:
        # As torchtune's QLoRA builders do: state_dict() gives the NF4 weights dequantised to the model's
        # dtype (on CPU, so a save does not hold a second copy on the accelerator), so checkpointing, merging
        # and state-dict loading see plain tensors.
        model.register_state_dict_post_hook(partial(
            reparametrize_as_dtype_state_dict_post_hook, dtype=model.tok_embeddings.weight.dtype, offload_to_cpu=True,
        ))
    return model
