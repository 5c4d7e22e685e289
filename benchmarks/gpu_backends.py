"""The GPU check's backends stage: one model, both policy backends, the same step.

Qwen3 is an architecture torchtune's modules build, so ``model.backend: auto`` trains it as torchtune's
``TransformerDecoder``; ``model.backend: transformers`` trains the same weights as transformers' own
``Qwen3ForCausalLM``, the module every 2026 family runs as (docs/models.md). This stage runs the real recipe on one
random directory of the **Qwen3-0.6B shape** (benchmarks/hf_random.py ``qwen3_0_6b``; ``tiny_qwen3`` with
``--tiny``) once per backend, on the same workload (benchmarks/gpu_qwen3_5.py's options: prompts x group, lengths,
steps), and reports:

- each run's step, generation and training seconds (medians over the steps after the first, which compiles the
  decode step on CUDA), tokens/s and peak memory, from the recipe's own ``metrics.jsonl``;
- what each run really did, observed while it ran (benchmarks/gpu_qwen3_5.py ``observed_paths``): the training
  layout of the update's forwards and the engine path that sampled;
- the ratios transformers / torchtune of the whole step, the generation and the training: how far the module of
  the 2026 families is from torchtune's on the device users train on.

    python benchmarks/gpu_backends.py --json backends.json                  # on a GPU (scripts/gpu_check.sh)
    python benchmarks/gpu_backends.py --device cpu --tiny --json out.json   # its CPU rehearsal

Exit status 1 when a run raised (the error is in the JSON).
"""

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

import gpu_grpo  # benchmarks/ is on sys.path: this script's directory
import gpu_qwen3_5

SHAPE, TINY_SHAPE = "qwen3_0_6b", "tiny_qwen3"
BACKENDS = ("torchtune", "transformers")
RATIO_KEYS = {"step": "time/step", "generation": "time/generation", "train": "time/train"}


@contextmanager
def torchtune_engine_paths(seen: "gpu_qwen3_5.ObservedPaths") -> Iterator[None]:
    """Inside: record in ``seen.engine`` each rollout the native engine starts on torchtune's modules (its rollout
    layout, and whether the decode step is compiled); it computes exactly what it did."""
    from torchtune_grpo.generation._native import NativeGenerator

    new_rollout = NativeGenerator.new_rollout

    def spy(engine, *a, **kw):
        run = new_rollout(engine, *a, **kw)
        decode = "compiled decode" if run.compiled else ("compaction" if engine.compact_decode else "no compaction")
        seen.engine[f"native engine on torchtune's modules: {type(run).__name__} + {decode}"] += 1
        return run

    NativeGenerator.new_rollout = spy
    try:
        yield
    finally:
        NativeGenerator.new_rollout = new_rollout


def backend_overrides(directory: Path, backend: str) -> Dict[str, Any]:
    """The recipe's ``model`` node: the shipped config's one-line model on ``directory``, ``backend`` forced."""
    return {"model": {"_component_": "torchtune_grpo.models.hf_model", "path": str(directory), "backend": backend}}


def ratios(runs: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    """transformers / torchtune of each median in :data:`RATIO_KEYS` both runs have (above zero)."""
    out = {}
    for label, key in RATIO_KEYS.items():
        a = (runs.get("torchtune") or {}).get("median", {}).get(key)
        b = (runs.get("transformers") or {}).get("median", {}).get(key)
        if a and b:
            out[label] = b / a
    return out


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """The recipe on the shape's directory with each backend in turn (torchtune first), as the docstring says."""
    shape = TINY_SHAPE if args.tiny else SHAPE
    gpu_grpo.MODEL_DIR = Path(args.model_dir)
    device = torch.device(args.device)
    directory = gpu_grpo.model_dir(shape)
    result: Dict[str, Any] = {"model": shape, "directory": str(directory), "device": args.device,
                              "workload": {k: getattr(args, k) for k in ("prompts", "group", "min_prompt_len",
                                                                       "max_prompt_len", "response_len",
                                                                       "micro_batch", "recipe_steps")},
                              "runs": {}, "paths": {}, "errors": []}
    started = time.perf_counter()
    for backend in BACKENDS:
        run_args = argparse.Namespace(**{**vars(args), "recipe_overrides": backend_overrides(directory, backend)})
        # A compiled decode that raises is kept as an error and the run repeated eagerly ("eager_fallback").
        seen, r = gpu_qwen3_5.observed_recipe(shape, device, run_args, result["errors"],
                                              label=f"recipe {shape} backend={backend}", spies=torchtune_engine_paths)
        if r is not None:
            result["runs"][backend] = r
        result["paths"][backend] = seen.summary()
        print(json.dumps({backend: result["paths"][backend]}), flush=True)
        gpu_grpo.free_memory()
    result["transformers_over_torchtune"] = ratios(result["runs"])
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu_qwen3_5.add_args(parser)
    args = parser.parse_args(argv)
    gpu_qwen3_5.finish_args(args)
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, default=str), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
