"""Mixture-of-experts weights for vLLM: the names its loaders expect, and a repair after its in-place reload.

A transformers policy holds each MoE layer's experts fused (transformers 5): ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (gate rows first, then up) and ``mlp.experts.down_proj`` ``[E, H, I]``; gpt-oss transposed and
interleaved, ``[E, H, 2I]`` and ``[E, I, H]``, with biases. vLLM loads the layout of the family's checkpoints
on the Hub:

============  ======================================================================  =================
family        vLLM's checkpoint names for expert ``e`` of layer ``l``                 router
============  ======================================================================  =================
qwen3_moe,    ``model.layers.l.mlp.experts.e.{gate,up,down}_proj.weight`` (``[I, H]``,  ``mlp.gate``
olmoe,        ``[I, H]``, ``[H, I]``)
qwen3_5_moe
mixtral       ``model.layers.l.block_sparse_moe.experts.e.{w1,w3,w2}.weight``           ``block_sparse_moe.gate``
              (gate, up, down)
gpt_oss       fused, as transformers holds them (``mlp.experts.gate_up_proj`` ...)     ``mlp.router``
============  ======================================================================  =================

:func:`checkpoint_tensors` splits a fused tensor into those per-expert tensors as views (no copy: the
stream holds one layer's experts, the gathered tensor itself). vLLM 0.32's qwen3_moe and olmoe loaders
also accept the fused tensors (measured: the same probe log-probabilities), mixtral's does not; the
per-expert names are the checkpoint format every vLLM version loads, so they are what is sent.

gpt-oss cannot be synced into vLLM 0.32 in place: its loader copies the attention sinks and the experts'
weights and biases straight into the parameters (``param.copy_``) instead of through their weight loaders,
so vLLM's in-place reload, which counts what the weight loaders receive, never sees them and restores the
old values (measured: after a sync the sinks and experts were unchanged). :func:`check_vllm_sync` refuses
it by name.

vLLM 0.32's CPU MoE kernel (``CPUUnquantizedExperts``) prepacks ``w13_weight``/``w2_weight`` once, when the
model is first loaded; its in-place reload (``reload_weights``, and the layerwise reload the server's
weight transfer uses) copies the new values back *unpacked* and does not prepack again
(``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts' ``process_weights_after_loading`` only on
the first load). The kernel then reads unpacked weights as packed ones: after syncing identical weights the
probe differed by 2.4 nats. :func:`reprocess_cpu_moe_experts` prepacks the layers a sync reloaded.
"""

import json
import os
import re
from typing import Iterable, Iterator, Set, Tuple

import torch
from torch import nn

__all__ = ["MOE_CHECKPOINT_NAMES", "check_vllm_sync", "checkpoint_tensors", "moe_layers_in",
           "reprocess_cpu_moe_experts"]

# model_type -> (module holding the MoE block on disk, (gate, up, down) per-expert names); None: fused on disk.
MOE_CHECKPOINT_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe_text": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "gpt_oss": None,
}

_FUSED = re.compile(r"^(?P<layer>.*\.layers\.\d+\.)mlp\.experts\.(?P<what>gate_up_proj|down_proj)$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def checkpoint_tensors(name: str, tensor: torch.Tensor, model_type: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """One transformers parameter of a MoE model as the tensor(s) vLLM loads for it (Hugging Face names in).

    Fused expert tensors of per-expert families become ``E`` (down) or ``2 E`` (gate, up) views; mixtral's
    ``mlp.*`` becomes ``block_sparse_moe.*``; everything else passes unchanged.

    Args:
        name (str): the parameter's name in the transformers module (``model.layers.3.mlp.experts.gate_up_proj``).
        tensor (torch.Tensor): its full value; fused experts ``[E, 2I, H]`` / ``[E, H, I]``.
        model_type (str): the checkpoint's ``model_type``.

    Yields:
        Tuple[str, torch.Tensor]: vLLM checkpoint names and tensors (``[I, H]``, ``[I, H]``, ``[H, I]`` per expert).

    Raises:
        ValueError: fused experts of a ``model_type`` without a mapping here (naming it and those supported).
    """
    match = _FUSED.match(name)
    if model_type not in MOE_CHECKPOINT_NAMES:
        if match is not None:
            raise ValueError(
                f"vLLM weight sync: {name} holds fused experts of model_type {model_type!r}, whose vLLM checkpoint "
                f"names are not known here; supported MoE model types: {sorted(MOE_CHECKPOINT_NAMES)}"
            )
        yield name, tensor
        return
    names = MOE_CHECKPOINT_NAMES[model_type]
    if names is None:  # fused on disk (gpt-oss): vLLM's loader takes transformers' tensors as they are
        yield name, tensor
        return
    block, (gate, up, down) = names
    if match is None:
        if block != "mlp":
            name = name.replace(".mlp.", f".{block}.", 1)
        yield name, tensor
        return
    prefix = f"{match['layer']}{block}.experts."
    if match["what"] == "down_proj":  # [E, H, I]
        for e in range(tensor.shape[0]):
            yield f"{prefix}{e}.{down}.weight", tensor[e]
        return
    if tensor.shape[1] % 2:
        raise ValueError(f"vLLM weight sync: {name} has {tensor.shape[1]} gate+up rows, not an even number")
    inner = tensor.shape[1] // 2  # [E, 2I, H]: gate rows, then up rows
    for e in range(tensor.shape[0]):
        yield f"{prefix}{e}.{gate}.weight", tensor[e, :inner]
        yield f"{prefix}{e}.{up}.weight", tensor[e, inner:]


def moe_layers_in(names: Iterable[str]) -> Set[int]:
    """Decoder layer indices of the expert tensors among ``names`` (vLLM checkpoint names)."""
    return {int(m.group(1)) for n in names if ".experts." in n and (m := _LAYER.search(n)) is not None}


def reprocess_cpu_moe_experts(model: nn.Module, layers: Set[int]) -> int:
    """Prepack again the expert weights of ``layers`` after vLLM's in-place reload, on vLLM's CPU MoE kernel.

    Only the layers a whole sync reloaded may be passed: their ``w13_weight``/``w2_weight`` hold the new values
    unpacked. A layer the reload did not touch still holds packed weights, and packing twice corrupts them.
    Other kernels (CUDA, zentorch) are left alone: their weight update redoes their own processing.

    Args:
        model (nn.Module): vLLM's model object.
        layers (Set[int]): decoder layers whose experts were reloaded (:func:`moe_layers_in`).

    Returns:
        int: the number of expert modules prepacked.
    """
    done = 0
    for module_name, module in model.named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is None or type(experts).__name__ not in _CPU_PREPACKING or getattr(experts, "_use_zentorch", False):
            continue
        match = _LAYER.search(f".{module_name}.")
        if match is None or int(match.group(1)) not in layers:
            continue
        experts.process_weights_after_loading(module)
        done += 1
    return done


# vLLM 0.32's unquantized CPU expert kernels (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py), whose
# process_weights_after_loading pads and prepacks w13/w2.
_CPU_PREPACKING = ("CPUUnquantizedExperts", "X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts",
                   "PowerCPUUnquantizedExperts")


def check_vllm_sync(model_dir: str, engine: str) -> None:
    """Fail, before an engine starts, for a MoE family whose weights vLLM's in-place reload cannot take.

    Args:
        model_dir (str): the engine's Hugging Face directory (nothing is checked without a ``config.json``).
        engine (str): the engine's name, for the message.

    Raises:
        ValueError: for gpt-oss (naming the engine and what to use instead).
    """
    path = os.path.join(str(model_dir), "config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type == "gpt_oss":
        raise ValueError(
            f"generation: {engine} cannot take a gpt_oss policy's weights: vLLM 0.32's gpt-oss loader copies the "
            "attention sinks and the experts' weights and biases directly, past the in-place reload the weight "
            "sync uses, so the engine would keep sampling from its checkpoint's weights. Sample with "
            "torchtune_grpo.generation.TransformersGenerator or NativeGenerator (docs/vllm.md)."
        )
