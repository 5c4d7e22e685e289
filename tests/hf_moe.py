"""Tiny random mixture-of-experts checkpoints, made by transformers in the test (see :mod:`tests.hf_families`).

``make_family_dir(family, directory, seed=0, peaked=True, router_gain=ROUTER_GAIN, dtype=torch.float32)``
(:mod:`tests.hf_families`) writes them for ``family`` in :data:`MOE_FAMILY_NAMES`:

- ``qwen3_moe`` (Qwen3-30B-A3B's layout), ``olmoe``, ``mixtral``: every layer a sparse MoE block; on disk
  transformers writes the experts one by one (``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral
  ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` and ``block_sparse_moe.gate.weight``), in memory they are
  fused 3-D parameters (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``);
- ``gpt_oss``: attention sinks, sliding (``WINDOW`` = 6 tokens) and full layers alternating, q/k/v/o biases,
  YaRN with original length 16, a biased router (top-k on logits, softmax over the k), experts fused on disk
  as in memory (``gate_up_proj [E, H, 2I]`` with gate/up interleaved, biases); ``dtype=torch.bfloat16``
  writes the bf16 checkpoint a user converts from MXFP4;
- ``qwen3_5_moe``: multimodal on disk like the dense Qwen3.5 ones (:mod:`tests.hf_multimodal`: language model
  under ``model.language_model.``, a one-layer vision tower ``model.visual.*``, ``mtp.*``), its language model
  a ``qwen3_5_moe_text`` with a Gated DeltaNet and a gated full-attention layer, each with a sparse MoE block
  plus the shared expert and its sigmoid gate; ``qwen3_5_moe_text`` alone is the text-only directory.

Every family has 4 experts, top-k 2 (``norm_topk_prob`` true for the Qwen families, as their checkpoints
have it), attention peaked as the dense fixtures (:func:`tests.hf_families.sharpen`), and decisive routers:
the router weights are scaled by ``router_gain`` (default :data:`ROUTER_GAIN`), so that the gap between
the k-th and (k+1)-th router logit of a token is far above rounding (:func:`router_margins`; measured
values in :data:`MEASURED_ROUTER_MARGIN`): a 1e-5 comparison never hinges on a near-tie. The replay demo,
which wants the bf16/fp32 routing disagreements of real models, can lower ``router_gain``.
"""

from typing import Dict, List

import torch

from tests import family_templates as T
from tests.hf_families import qwen3_5_layers, WINDOW, Family

__all__ = ["DISK_EXPERT_NAMES", "MEASURED_PEAKEDNESS", "MEASURED_ROUTER_MARGIN", "MOE_FAMILIES", "MOE_FAMILY_NAMES",
           "MOE_LAYER_KINDS", "ROUTER_GAIN", "router_margins", "routers"]

ROUTER_GAIN = 4.0
MOE_FAMILY_NAMES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "olmoe", "mixtral")
_EXPERTS = dict(num_experts_per_tok=2)

MOE_FAMILIES: Dict[str, Family] = {
    "qwen3_moe": Family(
        "qwen3_moe",
        dict(num_hidden_layers=2, num_experts=4, moe_intermediate_size=64, norm_topk_prob=True, **_EXPERTS,
             rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        T.QWEN3, T.CHATML, eos="<|im_end|>", pad="<|endoftext|>", stops=["<|im_end|>", "<|endoftext|>"],
        added=["<think>", "</think>"]),
    "qwen3_5_moe_text": Family(
        "qwen3_5_moe_text",
        dict(**qwen3_5_layers(), num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
             **_EXPERTS, tie_word_embeddings=False),
        T.QWEN3_5, T.CHATML + T.QWEN_VISION, eos="<|im_end|>", pad="<|endoftext|>",
        stops=["<|im_end|>", "<|endoftext|>"], added=["<think>", "</think>"], offset_norm=True),
    "gpt_oss": Family(
        "gpt_oss",
        dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
             num_local_experts=4, **_EXPERTS, rope_parameters=dict(
                 rope_type="yarn", rope_theta=150000.0, factor=16.0, original_max_position_embeddings=16,
                 beta_fast=32.0, beta_slow=1.0, truncate=False)),
        T.GPT_OSS, T.GPT_OSS_SPECIALS, eos="<|return|>", pad="<|endoftext|>",
        stops=["<|return|>", "<|call|>", "<|endoftext|>"]),
    "olmoe": Family(
        "olmoe",
        dict(num_hidden_layers=2, num_experts=4, **_EXPERTS, rope_parameters=dict(rope_type="default",
                                                                                  rope_theta=10000.0)),
        T.OLMOE, T.OLMOE_SPECIALS, eos="<|endoftext|>", pad="<|padding|>", stops=["<|endoftext|>"]),
    "mixtral": Family(
        "mixtral",
        dict(num_hidden_layers=2, num_local_experts=4, **_EXPERTS, sliding_window=None,
             rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        T.MISTRAL, T.MISTRAL_SPECIALS, bos="<s>", eos="</s>", stops=["</s>"], bos_in_text=True),
}

# What :func:`tests.hf_families.layer_kinds` reports for each (the MoE blocks: :func:`routers`).
MOE_LAYER_KINDS: Dict[str, set] = {
    "qwen3_moe": {"full_attention"}, "olmoe": {"full_attention"}, "mixtral": {"full_attention"},
    "gpt_oss": {"sliding_attention", "full_attention"},
    "qwen3_5_moe_text": {"linear_attention", "full_attention"}, "qwen3_5_moe": {"linear_attention", "full_attention"},
}

# peakedness() (tests/hf_families.py) of each fixture, seed 0, probe_tokens(32), fp32 eager attention.
MEASURED_PEAKEDNESS = {"qwen3_moe": 0.839, "qwen3_5_moe": 0.852, "gpt_oss": 0.906, "olmoe": 0.838, "mixtral": 0.854}
# On-disk names of layer 0's first expert and router (what transformers' save_pretrained writes).
DISK_EXPERT_NAMES = {
    "qwen3_moe": ["model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.gate.weight"],
    "olmoe": ["model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.gate.weight"],
    "mixtral": ["model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.block_sparse_moe.gate.weight"],
    "gpt_oss": ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias",
                "model.layers.0.mlp.router.bias", "model.layers.0.self_attn.sinks"],
    "qwen3_5_moe": ["model.language_model.layers.0.mlp.experts.0.down_proj.weight",
                    "model.language_model.layers.0.mlp.shared_expert_gate.weight",
                    "model.visual.merger.linear_fc1.weight",
                    "mtp.fc.weight"],
}

# min and median over the probe's (token, MoE layer) pairs of router_margins() (seed 0, probe_tokens(32), fp32;
# 2-core AVX-512 Xeon, transformers 5.19). Rounding moves a logit by ~1e-6 here.
MEASURED_ROUTER_MARGIN: Dict[str, tuple] = {
    "qwen3_moe": (0.0045, 1.971), "qwen3_5_moe": (0.0555, 3.493), "gpt_oss": (0.0079, 1.555),
    "olmoe": (0.0031, 2.043), "mixtral": (0.0057, 1.497)}


def routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's router modules (transformers' ``...TopKRouter``: ``mlp.gate`` or gpt-oss's ``mlp.router``),
    one per MoE layer, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def router_margins(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The gap between each token's k-th and (k+1)-th largest router logit, in every MoE layer.

    Softmax is monotonic, so this gap decides whether a small change of the logits changes the chosen experts.

    Args:
        model (torch.nn.Module): a transformers MoE causal LM.
        tokens (torch.Tensor): ``[B, T]`` ids.

    Returns:
        torch.Tensor: ``[num_moe_layers, B*T]`` gaps (>= 0).
    """
    logits = []
    hooks = [r.register_forward_hook(lambda m, i, out: logits.append(out[0].detach())) for r in routers(model)]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for h in hooks:
            h.remove()
    k = routers(model)[0].top_k
    top = torch.stack(logits).topk(k + 1, dim=-1).values  # [L, B*T, k+1]
    return top[..., k - 1] - top[..., k]
