"""The GPU check's mixture-of-experts stage: Qwen3-30B-A3B's layer, scaled down to one GPU, ours beside TRL.

The model is a random directory of the **Qwen3-30B-A3B layout with 2 of its 48 layers** (benchmarks/hf_random.py
``qwen3_30b_a3b_2l``: every layer as published, hidden 2048, 32 Q / 4 KV heads of 128, 128 experts of 768 with 8
per token, vocabulary 151,936, untied head; 1.87B parameters, bf16 safetensors written per expert as the
published checkpoint is). Only the layer count is cut, so a layer's routing, its experts' sizes and what FSDP2
gathers at once (one decoder layer, 623M parameters) are the real model's; ``tiny_qwen3_moe`` with ``--tiny``.
It runs benchmarks/gpu_qwen3_5.py's stage on it:

1. our recipe from the shipped ``configs/qwen3_moe/30B-A3B_full_grpo.yaml`` with ``checkpointer.checkpoint_dir``
   changed and ``fsdp_cpu_offload`` off (the stand-in fits on the GPU; no KL term, as that config), transformers'
   ``Qwen3MoeForCausalLM``
   through the transformers backend, 16 prompts x 8 completions of at most 256 tokens, 2 steps, the second
   measured: step time, generation and update apart, the peak of the device allocator;
2. TRL's GRPOTrainer on the same directory and batch (``beta`` 0: no reference model either), one warm-up and
   one measured step, if the time budget is not spent: its step time and peak;
3. the paper estimate of our peak for the same run (benchmarks/moe_memory.py: one GPU, the batch above), beside
   the measured one, so a GPU run checks the memory model docs/moe.md uses for the 8-GPU table.

    python benchmarks/gpu_moe.py --json moe.json                  # on a GPU (scripts/gpu_check.sh, stage moe)
    python benchmarks/gpu_moe.py --device cpu --tiny --json out.json   # its CPU rehearsal

Exit status 1 when a part raised (the error is in the JSON).
"""

import argparse
import math
import sys
from typing import Any, Dict, List, Optional

import gpu_qwen3_5  # benchmarks/ is on sys.path: this script's directory
import hf_random
import moe_memory

SHAPE, TINY_SHAPE = "qwen3_30b_a3b_2l", "tiny_qwen3_moe"
RECIPE_CONFIG = "configs/qwen3_moe/30B-A3B_full_grpo.yaml"
PUBLISHED_LAYERS = 48  # Qwen3-30B-A3B's; the stage's directory keeps 2


def paper_estimate(shape: str, args: argparse.Namespace) -> Dict[str, Any]:
    """benchmarks/moe_memory.py's rows for this run on one GPU (GB), and the parameters of the directory."""
    fields = moe_memory.language_fields(hf_random.hf_config(shape).to_dict(), shape)
    setup = moe_memory.Setup(gpus=1, rows=args.prompts * args.group, micro_batch=args.micro_batch,
                             seq_len=args.max_prompt_len + args.response_len, chunk=args.chunk_size,
                             activation_checkpointing=args.activation_checkpointing, kl_reference=args.kl_coef > 0)
    rows = moe_memory.memory_rows(fields, setup)
    return {"parameters": moe_memory.parameter_counts(fields), "rows": {r.name: r.per_gpu / 1e9 for r in rows},
            "peak_gb": rows[-1].per_gpu / 1e9}


# The shipped config keeps its shards in host memory for the 30.5B model on 80 GB GPUs; the 1.87B stand-in
# fits on one GPU, as TRL's copy does, so both sides hold their weights on the device.
RECIPE_OVERRIDES = {"fsdp_cpu_offload": False}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    shape = TINY_SHAPE if args.tiny else SHAPE
    args.recipe_overrides = dict(RECIPE_OVERRIDES)
    result = gpu_qwen3_5.run(args, shape=shape, recipe_config=RECIPE_CONFIG)
    result["recipe_overrides"] = args.recipe_overrides
    result["layout"] = {"layers": hf_random.SHAPES[shape]["num_hidden_layers"], "published_layers": PUBLISHED_LAYERS,
                        "experts": hf_random.SHAPES[shape]["num_experts"],
                        "experts_per_token": hf_random.SHAPES[shape]["num_experts_per_tok"]}
    try:
        estimate = paper_estimate(shape, args)
    except Exception as e:  # noqa: BLE001 - the measurement stands without the estimate
        result["errors"].append({"part": "paper estimate", "error": f"{type(e).__name__}: {e}"})
        return result
    measured = (result.get("recipe") or {}).get("median", {}).get("memory/peak_allocated_gib")
    # GiB from torch.cuda.max_memory_allocated on CUDA; no device peak on CPU (the recipe logs none: NaN)
    estimate["measured_peak_gb"] = measured * 2**30 / 1e9 if measured and math.isfinite(measured) else None
    result["paper_estimate"] = estimate
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu_qwen3_5.add_args(parser)
    parser.set_defaults(prompts=16, kl_coef=0.0)  # half the Qwen3 stages' batch, as the Qwen3.5 stage; no KL
    args = parser.parse_args(argv)
    gpu_qwen3_5.finish_args(args)
    return gpu_qwen3_5.report(run(args), args)


if __name__ == "__main__":
    sys.exit(main())
