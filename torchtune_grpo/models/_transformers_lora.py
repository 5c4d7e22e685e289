"""LoRA (Hu et al. 2021, arXiv:2106.09685) and QLoRA (Dettmers et al. 2023, arXiv:2305.14314) on a transformers
policy: torchtune's ``LoRALinear`` in place of the chosen ``nn.Linear`` layers.

The adapted layer keeps the base layer's name and its ``weight``/``bias`` tensors, so the base checkpoint loads
under transformers' own names, and everything the LoRA recipe does with torchtune's adapters works unchanged:
only adapter parameters train, the reference is the policy with its adapters disabled, the merge adds
``alpha / r * B A`` to ``<layer>.weight``, QLoRA's base weights are NF4. The PEFT export
(:func:`peft_names`) only renames: transformers' names are PEFT's, under ``base_model.model.``.

Targets are named as torchtune names them (``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``, ``w1``, ``w2``,
``w3``, ``output``), which map to the family's own layers (``o_proj``, ``gate_proj``, ``down_proj``,
``up_proj``, ``lm_head``; a fused ``qkv_proj`` / ``gate_up_proj`` where the family has one, as Phi-3/4), or by
the family's own layer names (any ``nn.Linear`` leaf, e.g. Qwen3.5's linear-attention ``in_proj_qkv``).

Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE, gpt-oss, OLMoE, Mixtral) take attention LoRA (and QLoRA's NF4
on the adapted attention layers). Their experts are fused 3-D parameters (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``down_proj``), not linear layers: MLP targets (``apply_lora_to_mlp``, ``w1``/``w2``/``w3`` or
the family's names) are refused naming the experts, and so, for the same reason, is NF4 for them. Routers
(``mlp.gate`` / gpt-oss's ``mlp.router``, transformers' ``...TopKRouter`` modules) are no target either: with
LoRA every base weight is frozen, so the experts and routers stay as loaded (never adapted, never
quantised), and the reference model routes as the policy's base.
"""

from typing import Dict, List, Sequence

import torch
from torch import nn
from torchtune import utils
from torchtune.modules.peft import LoRALinear

__all__ = ["add_lora", "fused_experts", "lora_target_names", "peft_names"]

log = utils.get_logger("INFO")

# torchtune's target name -> the family's layer names, in order of preference (a fused layer last).
_FROM_TORCHTUNE = {
    "q_proj": ("q_proj", "qkv_proj"),
    "k_proj": ("k_proj", "qkv_proj"),
    "v_proj": ("v_proj", "qkv_proj"),
    "output_proj": ("o_proj", "out_proj"),
    "w1": ("gate_proj", "gate_up_proj"),
    "w3": ("up_proj", "gate_up_proj"),
    "w2": ("down_proj",),
    "output": ("lm_head",),
}
# MLP targets, torchtune's and the families' own names: in a mixture of experts they mean the fused experts.
_MLP_TARGETS = {"w1", "w2", "w3", "gate_proj", "up_proj", "down_proj", "gate_up_proj"}
_ROUTER_TARGETS = {"gate", "router"}
NF4_BLOCK = 64 * 256  # torchao's NF4: blocks of 64 values, scalers in groups of 256 blocks


def _linear_leaves(model: nn.Module) -> Dict[str, List[str]]:
    leaves: Dict[str, List[str]] = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            leaves.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return leaves


def fused_experts(model: nn.Module) -> List[str]:
    """The names of a mixture of experts' fused 3-D expert weights (``...mlp.experts.gate_up_proj`` and
    ``down_proj``), empty for a dense model."""
    return [name for name, p in model.named_parameters()
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and p.dim() == 3]


def lora_target_names(model: nn.Module, targets: Sequence[str]) -> List[str]:
    """The family's layer names for ``targets`` (torchtune's names or the family's own).

    Raises:
        ValueError: a target the model has no layer for (naming it and the linear layers it has); an MLP or
            router target of a mixture-of-experts model (naming the fused experts / the router and why).
    """
    leaves = _linear_leaves(model)
    chosen: List[str] = []
    experts = fused_experts(model)
    for target in targets:
        if experts and target in _MLP_TARGETS:
            raise ValueError(
                f"LoRA target {target!r} (apply_lora_to_mlp or an MLP name): this mixture-of-experts model holds its "
                f"experts as fused 3-D parameters ({experts[0]} {tuple(model.get_parameter(experts[0]).shape)}, ...), "
                "not linear layers; adapters (and QLoRA's NF4) on them are not supported. Adapt attention only "
                "(lora_attn_modules, apply_lora_to_mlp: false): the experts stay frozen as loaded"
            )
        if experts and target in _ROUTER_TARGETS:
            raise ValueError(
                f"LoRA target {target!r}: the mixture-of-experts router (transformers' TopKRouter) is not a LoRA "
                "target: it stays frozen and unquantised, so the policy's base routes as the checkpoint does"
            )
        options = _FROM_TORCHTUNE.get(target, ()) + ((target,) if target not in _FROM_TORCHTUNE else ())
        found = next((leaf for leaf in options if leaf in leaves), None)
        if found is None:
            raise ValueError(
                f"LoRA target {target!r}: this model has no such linear layer; its linear layers are "
                f"{sorted(leaves)} (name them directly, or use torchtune's names {sorted(_FROM_TORCHTUNE)})"
            )
        if found not in chosen:
            chosen.append(found)
    return chosen


def add_lora(model: nn.Module, targets: Sequence[str], *, rank: int, alpha: float, dropout: float,
             quantize_base: bool) -> List[str]:
    """Replace every linear layer named by ``targets`` (see :func:`lora_target_names`) with a ``LoRALinear``.

    Call it on a model whose parameters are on the meta device (the adapters are initialised after sharding).

    Args:
        model (nn.Module): a :class:`~torchtune_grpo.models.TransformersDecoder`.
        targets (Sequence[str]): layers to adapt.
        rank (int): LoRA rank r.
        alpha (float): LoRA alpha.
        dropout (float): dropout on the adapter input.
        quantize_base (bool): NF4 base weights (QLoRA).

    Returns:
        List[str]: the layer names adapted.

    Raises:
        ValueError: an unknown target; with ``quantize_base``, a weight NF4 cannot quantise (naming it); LoRA on
            the output projection of a tied model.
    """
    if {"output", "lm_head"} & set(targets) and type(model.causal_lm.get_output_embeddings()) is not nn.Linear:
        raise ValueError("apply_lora_to_output: the output projection is the input embedding (tied): not adapted")
    names = lora_target_names(model, targets)
    if fused_experts(model):
        log.info("LoRA on a mixture of experts: adapters on %s; the fused experts and the routers stay frozen%s",
                 names, ", unquantised (NF4 on the adapted layers only)" if quantize_base else "")
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.rsplit(".", 1)[-1] not in names:
            continue
        if quantize_base and module.weight.numel() % NF4_BLOCK:
            raise ValueError(
                f"quantize_base: {name}.weight has {module.weight.numel()} values, not a multiple of {NF4_BLOCK} "
                "(NF4 blocks): leave that layer out of the targets or train without quantize_base"
            )
        lora = LoRALinear(
            module.in_features, module.out_features, rank=rank, alpha=alpha, dropout=dropout,
            use_bias=module.bias is not None, quantize_base=quantize_base,
        )
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, lora)
    return names


def peft_names(adapter_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A transformers policy's adapter weights under PEFT's names (``base_model.model.<name>.lora_A.weight``)."""
    out = {}
    for key, value in adapter_state.items():
        key = key.replace(".lora_a.", ".lora_A.").replace(".lora_b.", ".lora_B.")
        out[f"base_model.model.{key}"] = value
    return out
