"""LoRA helpers for the GRPO LoRA recipe: adapter hyper-parameters, the PEFT export, NF4 base weights.

Nothing here touches ``torch.distributed``: the recipe gathers full (unsharded) state dicts first.

PEFT export. torchtune 0.6.1's ``convert_weights.tune_to_peft_adapter_weights`` always permutes the q/k
``lora_B`` rows from torchtune's interleaved RoPE layout to Hugging Face's half-split one. That is right for
the Llama family, whose torchtune checkpoints are permuted on load, but wrong for Qwen2 (Qwen2.5), whose
torchtune model keeps Hugging Face's layout (``qwen2_hf_to_tune`` does not permute): a Qwen2 adapter saved by
torchtune's checkpointer gives different logits in PEFT. :func:`peft_adapter_weights` undoes that permutation
for such model types.
"""

import json
import os
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from safetensors.torch import save_file
from torch import nn
from torchtune.models import convert_weights
from torchtune.modules.peft import LoRALinear

from torchtune_grpo.models import HeadNormLoRALinear
from torchtune_grpo.models._transformers_lora import peft_names

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_PEFT_FILE",
    "ADAPTER_TORCHTUNE_FILE",
    "LoRAHyperparams",
    "load_nf4_base_weights",
    "lora_hyperparams",
    "nf4_parameters",
    "peft_adapter_config",
    "peft_adapter_weights",
    "read_hf_config",
    "save_adapter",
]

ADAPTER_PEFT_FILE = "adapter_model.safetensors"  # PEFT: PeftModel.from_pretrained(base, directory)
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_TORCHTUNE_FILE = "adapter_model.pt"  # torchtune keys: what a resumed run loads

# torchtune model types whose attention weights keep Hugging Face's q/k row order (no RoPE permutation in
# their checkpoint conversion), so their adapters must not be permuted either.
_HF_QK_LAYOUT = {"QWEN2", "QWEN3"}
# LoRA layers whose update is the plain low-rank one (a Qwen3 q/k projection adds a norm after it, which the
# merge and the PEFT export handle like any other base weight).
_PLAIN_LORA = (LoRALinear, HeadNormLoRALinear)
# torchtune has no PEFT conversion for these (its own checkpointer skips them too).
_NO_PEFT = {"PHI3_MINI", "PHI4", "LLAMA3_VISION"}


class LoRAHyperparams(NamedTuple):
    """What the adapter files record about a LoRA model.

    Attributes:
        rank (int): LoRA rank r.
        alpha (float): LoRA alpha (the update is scaled by alpha / r).
        target_modules (List[str]): adapted modules, torchtune names (``q_proj``, ``output_proj``, ``w1``...).
    """

    rank: int
    alpha: float
    target_modules: List[str]


def lora_hyperparams(model: nn.Module) -> LoRAHyperparams:
    """Read rank, alpha and the adapted module names off a torchtune LoRA model.

    Reading them from the modules (rather than from the config) also covers builders that default them.

    Raises:
        ValueError: if the model has no :class:`~torchtune.modules.peft.LoRALinear` (not a ``lora_*``
            builder), if it uses DoRA, or if its LoRA layers disagree on rank or alpha.
    """
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not found:
        raise ValueError(
            "The model has no LoRA layers: use a torchtune LoRA builder (e.g. "
            "torchtune.models.qwen2_5.lora_qwen2_5_3b) with lora_attn_modules, lora_rank and lora_alpha."
        )
    if any(type(m) not in _PLAIN_LORA for _, m in found):
        raise ValueError("Only plain LoRA (LoRALinear) is supported by this recipe: set use_dora: False.")
    ranks = {m.rank for _, m in found}
    alphas = {float(m.alpha) for _, m in found}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"All LoRA layers must share rank and alpha, got ranks {ranks}, alphas {alphas}")
    targets = []
    for name, _ in found:
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets:
            targets.append(leaf)
    return LoRAHyperparams(rank=ranks.pop(), alpha=alphas.pop(), target_modules=targets)


def nf4_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """The NF4-quantised base weights of a QLoRA model (``quantize_base=True``), by parameter name."""
    return [
        (f"{name}.weight", m.weight)
        for name, m in model.named_modules()
        if isinstance(m, LoRALinear) and m._quantize_base
    ]


def load_nf4_base_weights(
    model: nn.Module, state_dict: Dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> List[str]:
    """Quantise the base weights of every NF4 LoRA layer from ``state_dict`` and set them in place.

    The entries used are removed from ``state_dict`` (the rest is loaded the usual way). The new
    parameters are frozen plain (unsharded) NF4 tensors with the block sizes the model was built with.

    Returns:
        List[str]: the parameter names set.
    """
    from torchao.dtypes.nf4tensor import to_nf4

    names = []
    for name, module in model.named_modules():
        if not (isinstance(module, LoRALinear) and module._quantize_base):
            continue
        key = f"{name}.weight"
        old = module.weight
        full = state_dict.pop(key).to(device=device, dtype=dtype)
        nf4 = to_nf4(full, block_size=old.block_size, scaler_block_size=old.scaler_block_size)
        module.weight = nn.Parameter(nf4, requires_grad=False)
        names.append(key)
    return names


def peft_adapter_weights(
    adapter_state: Dict[str, torch.Tensor],
    *,
    model_type: str,
    num_heads: int,
    num_kv_heads: int,
    dim: int,
    head_dim: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """torchtune adapter keys and layout -> PEFT's (``base_model.model.model.layers.0.self_attn...``).

    Args:
        adapter_state (Dict[str, torch.Tensor]): ``lora_a``/``lora_b`` weights under torchtune names.
        model_type (str): the checkpointer's ``model_type`` (e.g. ``"QWEN2"``, ``"LLAMA3_2"``).
        num_heads (int): attention heads (Hugging Face ``num_attention_heads``).
        num_kv_heads (int): key/value heads.
        dim (int): model width (``hidden_size``).
        head_dim (Optional[int]): per-head width. Default is None (``dim // num_heads``).

    Returns:
        Dict[str, torch.Tensor]: the PEFT state dict.
    """
    head_dim = head_dim or dim // num_heads
    out = convert_weights.tune_to_peft_adapter_weights(
        dict(adapter_state), num_heads=num_heads, num_kv_heads=num_kv_heads, dim=dim, head_dim=head_dim
    )
    if model_type.upper() in _HF_QK_LAYOUT:
        for key, value in out.items():
            if "lora_B" in key and (".q_proj." in key or ".k_proj." in key):
                # Inverse of torchtune's [H, D/2, 2, r] -> [H, 2, D/2, r] interleave permutation.
                rank = value.shape[-1]
                heads = value.shape[0] // head_dim
                out[key] = (
                    value.view(heads, 2, head_dim // 2, rank).transpose(1, 2).reshape(-1, rank).contiguous()
                )
    return out


def peft_adapter_config(
    hparams: LoRAHyperparams, base_model_name_or_path: Optional[str] = None
) -> Dict[str, Any]:
    """The ``adapter_config.json`` PEFT reads (``LoraConfig``)."""
    config = convert_weights.tune_to_peft_adapter_config(
        {"r": hparams.rank, "lora_alpha": hparams.alpha, "target_modules": list(hparams.target_modules)},
        base_model_name_or_path=base_model_name_or_path,
    )
    config.update({"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0})
    return config


def save_adapter(
    directory: Path,
    adapter_state: Dict[str, torch.Tensor],
    hparams: LoRAHyperparams,
    *,
    model_type: str,
    hf_config: Dict[str, Any],
    base_model_name_or_path: Optional[str] = None,
) -> List[Path]:
    """Write the adapter: PEFT files (unless the model type has no PEFT mapping) and torchtune's ``.pt``.

    Args:
        directory (Path): where to write (created if needed).
        adapter_state (Dict[str, torch.Tensor]): adapter weights under torchtune names, on CPU.
        hparams (LoRAHyperparams): see :func:`lora_hyperparams`.
        model_type (str): the checkpointer's ``model_type``.
        hf_config (Dict[str, Any]): the base model's Hugging Face ``config.json``.
        base_model_name_or_path (Optional[str]): recorded in ``adapter_config.json`` for PEFT. Default is
            None.

    Returns:
        List[Path]: the files written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / ADAPTER_TORCHTUNE_FILE]
    torch.save(adapter_state, written[0])
    if model_type.upper() in _NO_PEFT:
        return written
    text_config = hf_config.get("text_config", hf_config)
    if any(key.startswith(("model.", "lm_head.")) for key in adapter_state):
        # A transformers policy: its names are already Hugging Face's (models/_transformers_lora.py).
        save_file({k: v.contiguous() for k, v in peft_names(adapter_state).items()}, directory / ADAPTER_PEFT_FILE,
                  metadata={"format": "pt"})
        config = {"r": hparams.rank, "lora_alpha": hparams.alpha, "target_modules": list(hparams.target_modules),
                  "peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0}
        if base_model_name_or_path:
            config["base_model_name_or_path"] = base_model_name_or_path
        with open(directory / ADAPTER_CONFIG_FILE, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        return written + [directory / ADAPTER_PEFT_FILE, directory / ADAPTER_CONFIG_FILE]
    weights = peft_adapter_weights(
        adapter_state,
        model_type=model_type,
        num_heads=text_config["num_attention_heads"],
        num_kv_heads=text_config.get("num_key_value_heads", text_config["num_attention_heads"]),
        dim=text_config["hidden_size"],
        head_dim=text_config.get("head_dim", None),
    )
    save_file({k: v.contiguous() for k, v in weights.items()}, directory / ADAPTER_PEFT_FILE,
              metadata={"format": "pt"})
    with open(directory / ADAPTER_CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(peft_adapter_config(hparams, base_model_name_or_path), f, indent=2)
    written += [directory / ADAPTER_PEFT_FILE, directory / ADAPTER_CONFIG_FILE]
    return written


def read_hf_config(checkpoint_dir: str) -> Dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory."""
    with open(os.path.join(checkpoint_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)
