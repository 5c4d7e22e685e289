"""The GPU check's Qwen3.5 stage: the transformers backend on a Qwen3.5-0.8B-shaped random model, beside TRL.

Qwen3.5 is not one of the architectures torchtune's modules build, so ``model.backend: auto`` trains it as
transformers' own module (``Qwen3_5ForCausalLM``: Gated DeltaNet layers, through transformers' torch
implementation when flash-linear-attention is not installed, and gated full attention). This stage:

1. checks that the installed transformers knows ``qwen3_5_text`` (the GPU machine's 5.17 should: the
   family arrived in transformers 5.2); if not, it writes ``{"skipped": reason}`` and exits 0, and the
   report says why;
2. writes the random directory (benchmarks/hf_random.py ``qwen3_5_0_8b``: the text model's published
   shape, bf16 weights N(0, 0.02), norms 1; ``tiny_qwen3_5`` with ``--tiny``);
3. runs the real recipe on it (benchmarks/gpu_grpo.py ``run_recipe``: the shipped Qwen3-0.6B config with
   only ``checkpointer.checkpoint_dir`` changed, synthetic id prompts, the even-id reward, no checkpoint
   save), the decode step eager (transformers' ``generate`` samples for this backend);
4. runs TRL's GRPOTrainer on the same directory and batch (benchmarks/gpu_trl.py ``run``), if the time
   budget (``--time-budget``, seconds since start) is not spent;
5. writes ``--json``: both results, the backend the recipe used and why, and the step-time ratio ours / TRL
   (our median ``time/step`` after the first step against TRL's median step after its warm-up).

    python benchmarks/gpu_qwen3_5.py --json qwen3_5.json                   # on a GPU (scripts/gpu_check.sh)
    python benchmarks/gpu_qwen3_5.py --device cpu --tiny --json out.json   # its CPU rehearsal

Exit status 1 when a part raised (the error is in the JSON).
"""

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

import gpu_grpo  # benchmarks/ is on sys.path: this script's directory
import gpu_trl
import hf_random
from harness import REPO

SHAPE, TINY_SHAPE = "qwen3_5_0_8b", "tiny_qwen3_5"
# The recipe's starting config: the shipped dense Qwen config of the nearest size (its model and checkpointer
# are the one-line Hugging Face components, so the directory alone decides the backend).
RECIPE_CONFIG = "configs/qwen3/0.6B_full_grpo.yaml"


def register(shape: str, recipe_config: str = RECIPE_CONFIG) -> None:
    """Make ``shape`` one of gpu_grpo's models (a random Hugging Face directory run from ``recipe_config``)."""
    gpu_grpo.MODELS[shape] = ("hf", shape, {})
    gpu_grpo.RECIPE_CONFIGS[shape] = recipe_config


def chosen_backend(directory: Path) -> Dict[str, str]:
    """The backend ``model.backend: auto`` picks for ``directory``, and why (as the recipe logs it)."""
    from torchtune_grpo.models import choose_backend, read_hf_config

    chosen = choose_backend(read_hf_config(str(directory)))
    return {"name": chosen.name, "reason": chosen.reason}


def run(args: argparse.Namespace, shape: Optional[str] = None, recipe_config: str = RECIPE_CONFIG) -> Dict[str, Any]:
    """Our recipe then TRL on one random directory (``shape``, default this stage's; benchmarks/gpu_moe.py
    passes its own shape and config), as the module docstring says."""
    shape = shape or (TINY_SHAPE if args.tiny else SHAPE)
    result: Dict[str, Any] = {"model": shape, "config": recipe_config, "device": args.device, "errors": [],
                              "skipped": None}
    available, reason = hf_random.model_type_available(shape)
    if not available:
        result["skipped"] = reason
        return result
    import transformers

    result["transformers"] = transformers.__version__
    started = time.perf_counter()
    register(shape, recipe_config)
    gpu_grpo.MODEL_DIR = Path(args.model_dir)
    device = torch.device(args.device)

    def attempt(label: str, fn) -> Optional[Dict[str, Any]]:
        print(f"=== {label}", flush=True)
        try:
            out = fn()
            print(json.dumps({k: v for k, v in out.items() if k != "all_steps"}, default=str), flush=True)
            return out
        except Exception as e:  # noqa: BLE001 - report it, and go on to the other side
            traceback.print_exc()
            result["errors"].append({"part": label, "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()[-3000:]})
            return None

    directory = gpu_grpo.model_dir(shape)
    result["backend"] = chosen_backend(directory)
    out_dir = tempfile.mkdtemp(prefix=f"gpu_hf_recipe_{shape}_")
    result["recipe"] = attempt(f"recipe {shape}", lambda: gpu_grpo.run_recipe(shape, device, args, out_dir))
    if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
        result["trl"] = None
        result["skipped_parts"] = [f"trl {shape} (time budget of {args.time_budget:.0f} s spent)"]
    else:
        trl_args = argparse.Namespace(**{**vars(args), "model": shape, "steps": args.trl_steps})
        result["trl"] = attempt(f"trl {shape}", lambda: gpu_trl.run(trl_args))
    ours = (result["recipe"] or {}).get("median", {}).get("time/step")
    theirs = (result["trl"] or {}).get("median_step_s")
    if ours and theirs:
        result["ours_vs_trl"] = {"ours_step_s": ours, "trl_step_s": theirs, "ratio": ours / theirs}
    result["seconds"] = time.perf_counter() - started
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    """This stage's options (benchmarks/gpu_moe.py takes the same)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: the tiny shape and batch")
    hf_random.add_workload_args(parser, steps=2)  # the same workload on both sides
    parser.add_argument("--recipe-steps", type=int, default=2, help="our recipe's steps (the first is warm-up)")
    parser.add_argument("--trl-steps", type=int, default=1, help="TRL's measured steps (after its warm-up)")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gpu_grpo_models"))
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: TRL is skipped (and listed as such) when our recipe has used them up")
    parser.add_argument("--json", default=None)


def finish_args(args: argparse.Namespace) -> None:
    """The tiny workload with ``--tiny``, the dtype for the device, eager decoding; the repository importable."""
    if args.tiny:
        hf_random.use_tiny_workload(args)
        args.chunk_size, args.recipe_steps, args.trl_steps = 64, 2, 1
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    args.compile_decode = False  # transformers' generate samples for this backend: nothing to compile
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args(argv)
    finish_args(args)
    return report(run(args), args)


def report(result: Dict[str, Any], args: argparse.Namespace) -> int:
    """Print a stage's result (without the per-side details), write it whole to ``--json``; the exit code."""
    print(json.dumps({k: v for k, v in result.items() if k not in ("recipe", "trl")}, default=str), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
