"""A Hugging Face ``config.json`` read into the few numbers a torchtune decoder is built from.

Everything the builder, the checkpointer and the weight sync need to know about an architecture is here,
checked once: a field this package does not implement (a sliding window, mixture-of-experts, a rope scaling
other than Llama 3's, quantised weights, ...) is an error naming the field, never a silently different model.
"""

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

__all__ = ["HFModelSpec", "Llama3RopeScaling", "SUPPORTED_MODEL_TYPES", "read_hf_config"]

# config.json ``model_type`` -> how its weights are laid out in torchtune. "interleaved": torchtune's Llama
# convention (q/k rows permuted on load, RoPE on adjacent pairs); "half": Hugging Face's own layout (RoPE on
# the two halves of each head), as torchtune's Qwen2 models keep it.
SUPPORTED_MODEL_TYPES = {
    "llama": "interleaved",  # Llama 2/3/3.1/3.2/3.3, SmolLM/SmolLM2 and other Llama-architecture models
    "mistral": "interleaved",
    "qwen2": "half",  # Qwen2, Qwen2.5
    "qwen3": "half",  # Qwen3 dense
}
_HINTS = {
    "qwen2_moe": "mixture-of-experts models are not supported",
    "qwen3_moe": "mixture-of-experts models are not supported",
    "mixtral": "mixture-of-experts models are not supported",
    "llama4": "Llama 4 (mixture-of-experts, multimodal) is not supported",
    "mllama": "Llama 3.2 Vision is not supported",
}
# Keys that, when set, mean a model this package would build wrongly.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def read_hf_config(path: Union[str, Path]) -> Dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory.

    Raises:
        FileNotFoundError: when ``path`` is not a directory or has no ``config.json``.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"model directory {directory} does not exist (set it to your `tune download --output-dir`)"
        )
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json: not a Hugging Face model directory "
            "(`tune download <repo> --output-dir DIR` writes one)"
        )
    with open(config_path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_scaling.rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class HFModelSpec:
    """The decoder a Hugging Face ``config.json`` describes, in torchtune's terms.

    Attributes:
        model_type (str): ``llama``, ``mistral``, ``qwen2`` or ``qwen3``.
        vocab_size (int): embedding rows.
        dim (int): model width (``hidden_size``).
        num_layers (int): transformer layers.
        num_heads (int): query heads.
        num_kv_heads (int): key/value heads.
        head_dim (int): per-head width (``head_dim``, else ``hidden_size // num_attention_heads``).
        intermediate_dim (int): MLP width.
        norm_eps (float): RMSNorm epsilon.
        rope_base (float): RoPE theta.
        rope_scaling (Optional[Llama3RopeScaling]): Llama 3.1 scaling, or None.
        max_seq_len (int): longest sequence the model is built for.
        tie_word_embeddings (bool): output projection shares the embedding matrix.
        qkv_bias (bool): q/k/v projections have biases (Qwen2).
        qk_norm (bool): per-head RMSNorm of queries and keys before RoPE (Qwen3).
        attn_dropout (float): attention dropout (training only).
    """

    model_type: str
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_dim: int
    norm_eps: float
    rope_base: float
    rope_scaling: Optional[Llama3RopeScaling]
    max_seq_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    attn_dropout: float = 0.0

    @property
    def rope_order(self) -> str:
        """The order of RoPE's rotated pairs in q/k rows: ``"interleaved"`` (torchtune's Llama order, q/k
        permuted) or ``"half"`` (Hugging Face's)."""
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def rope_layout(self) -> str:
        """The old name of :attr:`rope_order` (works until the next release, with a FutureWarning)."""
        warnings.warn("HFModelSpec.rope_layout is now rope_order; the old name works until the next release",
                      FutureWarning, stacklevel=2)
        return self.rope_order

    @classmethod
    def from_directory(cls, path: Union[str, Path], max_seq_len: Optional[int] = None) -> "HFModelSpec":
        """Read and check ``{path}/config.json`` (see :meth:`from_hf_config`)."""
        return cls.from_hf_config(read_hf_config(path), max_seq_len=max_seq_len, source=str(Path(path) / "config.json"))

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], max_seq_len: Optional[int] = None, source: str = "config.json"
    ) -> "HFModelSpec":
        """Check a Hugging Face config and read it into a spec.

        Args:
            config (Mapping[str, Any]): the parsed ``config.json``.
            max_seq_len (Optional[int]): build for at most this many positions (the RoPE cache and the
                recipe's length check). Default is None (``max_position_embeddings``).
            source (str): where the config came from, for messages. Default is ``"config.json"``.

        Returns:
            HFModelSpec: the spec.

        Raises:
            ValueError: for an unsupported ``model_type`` or a field whose value this package does not
                implement; the message names the field and what is supported.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = f" ({_HINTS[model_type]})" if model_type in _HINTS else ""
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported{hint}; supported: "
                f"{sorted(SUPPORTED_MODEL_TYPES)} (see docs/models.md, 'Adding an architecture')"
            )

        def unsupported(field: str, value: Any, supported: str) -> ValueError:
            return ValueError(f"{source}: {field} = {value!r} is not supported for {model_type}; supported: {supported}")

        for key in _MOE_KEYS:
            if config.get(key):
                raise unsupported(key, config[key], "dense models only (no mixture-of-experts)")
        if config.get("quantization_config"):
            method = dict(config["quantization_config"]).get("quant_method", "?")
            raise unsupported("quantization_config.quant_method", method, "unquantised bf16/fp16/fp32 weights")
        if config.get("hidden_act", "silu") != "silu":
            raise unsupported("hidden_act", config["hidden_act"], "'silu'")
        if config.get("mlp_bias", False):
            raise unsupported("mlp_bias", True, "false")
        if config.get("attention_bias", False):
            raise unsupported("attention_bias", True, "false (Qwen2's q/k/v biases are built in)")
        if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
            raise unsupported("partial_rotary_factor", config["partial_rotary_factor"], "1.0")
        if config.get("use_sliding_window", False):
            raise unsupported("use_sliding_window", True, "false (full attention in every layer)")
        layer_types = set(config.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise unsupported("layer_types", sorted(layer_types), "['full_attention'] only")

        dim = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        positions = int(config.get("max_position_embeddings", 4096))
        # Mistral's sliding window only differs from full attention past its length: build the model for
        # at most that many positions, so it is exactly the checkpoint's model wherever it runs.
        window = config.get("sliding_window") if model_type == "mistral" else None
        limit = min(positions, int(window)) if window else positions
        if max_seq_len is not None:
            if max_seq_len > limit:
                what = "sliding_window" if window and int(window) < positions else "max_position_embeddings"
                raise ValueError(f"max_seq_len = {max_seq_len} exceeds {source}'s {what} = {limit}")
            limit = int(max_seq_len)

        rope_base, rope_scaling = _rope(config, model_type, unsupported)
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            dim=dim,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or dim // num_heads),
            intermediate_dim=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_base=rope_base,
            rope_scaling=rope_scaling,
            max_seq_len=limit,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            attn_dropout=float(config.get("attention_dropout", 0.0) or 0.0),
        )


def _rope(config: Mapping[str, Any], model_type: str, unsupported) -> "tuple[float, Optional[Llama3RopeScaling]]":
    """RoPE base and scaling, from ``rope_theta`` + ``rope_scaling`` (Hub files) or ``rope_parameters``
    (what transformers 5 writes)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    field = "rope_parameters" if params else "rope_scaling"
    params = {**scaling, **params}
    base = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return base, None
    if rope_type != "llama3" or model_type not in ("llama",):
        allowed = "'default' (no scaling), and 'llama3' for model_type llama"
        raise unsupported(f"{field}.rope_type", rope_type, allowed)
    return base, Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
