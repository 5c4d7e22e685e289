"""Building the LoRA/QLoRA policy: base weights frozen (NF4 for QLoRA), adapters trainable, FSDP2.

As torchtune's ``lora_finetune_distributed``: meta-device init, per-layer ``fully_shard``, adapters
initialised after sharding; except that QLoRA's NF4 base weights are kept out of FSDP2 (``ignored_params``)
and held whole on every rank (see :func:`~torchtune_grpo.runtime.sharding.shard_model`).
"""

from itertools import chain
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torchtune import config, training, utils
from torchtune.modules.peft import get_adapter_params, LoRALinear, set_trainable_params

from torchtune_grpo.models.compiled import compile_decoder_layers
from torchtune_grpo.models.logprobs import set_head_precision
from torchtune_grpo.models.lora import LoRAHyperparams, load_nf4_base_weights, lora_hyperparams, nf4_parameters
from torchtune_grpo.runtime.compute import apply_activation_checkpointing
from torchtune_grpo.runtime.model_setup import (
    check_max_seq_len, check_state_dict_shapes, decoder_layer_classes, init_rope, load_full_state_dict, Placement,
)

__all__ = ["build_lora_model"]

log = utils.get_logger("INFO")


def build_lora_model(
    model_cfg, base_state: Dict[str, torch.Tensor], adapter_state: Optional[Dict[str, torch.Tensor]],
    placement: Placement, *, source: str, max_len: int,
) -> Tuple[nn.Module, LoRAHyperparams]:
    """The LoRA policy: ``base_state`` frozen, the adapters from ``adapter_state`` (a resume) or fresh.

    Args:
        model_cfg: the config's ``model`` node (a torchtune LoRA builder; ``quantize_base`` for QLoRA).
        base_state (Dict[str, torch.Tensor]): the base model's full weights (torchtune names).
        adapter_state (Optional[Dict[str, torch.Tensor]]): saved adapter weights, or None for a fresh adapter
            (A random, B zero: the initial policy is the base model).
        placement (Placement): device, processes, precision (every weight in its compute dtype), FSDP2 options.
        source (str): where the base weights came from, for error messages.
        max_len (int): ``max_prompt_length + max_response_length``, checked against ``max_seq_len``.

    Returns:
        Tuple[nn.Module, LoRAHyperparams]: the model (only adapter parameters require grad) and its LoRA
        rank, alpha and target modules.

    Raises:
        ValueError: for a model without LoRA layers, or weights that do not match it.
    """
    dtype, device, cpu_offload = placement.precision.compute_dtype, placement.device, placement.cpu_offload
    with training.set_default_dtype(dtype), torch.device("meta"):
        model = config.instantiate(model_cfg)
    lora = lora_hyperparams(model)  # raises for a model without LoRA layers
    check_max_seq_len(model, max_len)
    check_state_dict_shapes(chain(model.named_parameters(), model.named_buffers()), base_state, source)
    adapter_names = set(get_adapter_params(model))
    set_trainable_params(model, adapter_names)
    apply_activation_checkpointing(model, placement.checkpointed_layers(model), decoder_layer_classes(model))
    set_head_precision(model, placement.logprob_head)
    if placement.compile_backend is not None:  # the training layout's forwards only (models/compiled.py)
        compile_decoder_layers(model, placement.compile_backend, decoder_layer_classes(model))
    nf4 = frozenset(p for _, p in nf4_parameters(model))
    placement.shard(model, ignored_params=nf4)
    # NF4 weights first: model.state_dict() (used by every load below) dequantizes them through a torchtune
    # hook, which fails while they are still on the meta device.
    base_state = dict(base_state)
    nf4_keys = set(load_nf4_base_weights(model, base_state, device, dtype))
    if adapter_state is not None:
        loaded = load_full_state_dict(model, dict(adapter_state), device, cpu_offload=cpu_offload)
        if loaded.unexpected_keys or adapter_names - set(adapter_state):
            raise ValueError(
                f"The saved adapter does not match the model: unexpected {loaded.unexpected_keys}, "
                f"missing {sorted(adapter_names - set(adapter_state))}"
            )
    else:
        with training.set_default_dtype(dtype), device:
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    m.to_empty(device="cpu" if cpu_offload else device)
                    m.initialize_parameters()
    init_rope(model, device)
    loaded = load_full_state_dict(model, base_state, device, cpu_offload=cpu_offload)
    missing = set(loaded.missing_keys) - adapter_names - nf4_keys
    if missing or loaded.unexpected_keys:
        raise ValueError(
            f"The base checkpoint does not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(loaded.unexpected_keys)}"
        )
    training.validate_no_params_on_meta_device(model)
    set_trainable_params(model, adapter_names)  # loading assigned new parameters: freeze again
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    utils.log_rank_zero(
        log,
        f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {lora.target_modules}"
        f"{' with NF4 base weights (QLoRA)' if nf4 else ''}: {trainable:,} trainable parameters of "
        f"{total:,} ({100 * trainable / total:.2f}%)",
    )
    return model, lora
