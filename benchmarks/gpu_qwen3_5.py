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
   save): the native engine samples on transformers' own cache (each prompt prefilled once per group; on
   CUDA each decode step one compiled call on a fixed-shape cache (``--compile-decode``; if that run raises,
   the error is reported and the run repeated with eager decoding), elsewhere eager with finished rows
   compacted out), and the update trains in shared-prompt rows (the Gated DeltaNet layers take each row's
   sequences apart, the other layers keep the rows); ``paths`` says which decode ran;
4. runs the same recipe on a sliding-window family (``gemma3_1b``, Gemma 3 1B's text model with its
   windows; ``tiny_gemma3`` with ``--tiny``): shared-prompt rows with windows by position;
5. runs TRL's GRPOTrainer on the Qwen3.5 directory and batch (benchmarks/gpu_trl.py ``run``), if the time
   budget (``--time-budget``, seconds since start) is not spent;
6. writes ``--json``: the results, the backend each recipe run used and why, what each run really did
   (``paths``, observed while it ran: the training layout of the update's forwards, or one row per sequence
   with the reason, and the engine path that sampled), and the step-time ratio ours / TRL (our median
   ``time/step`` after the first step against TRL's median step after its warm-up).

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
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

import gpu_grpo  # benchmarks/ is on sys.path: this script's directory
import gpu_trl
import hf_random
from harness import REPO

SHAPE, TINY_SHAPE = "qwen3_5_0_8b", "tiny_qwen3_5"
# The family that takes the training layouts: Gemma 3's sliding and global attention layers.
LAYOUTS_SHAPE, TINY_LAYOUTS_SHAPE = "gemma3_1b", "tiny_gemma3"
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


_LAYOUT_NAMES = {"SharedPromptLayout": "shared prompts", "PackedLayout": "packed"}


class ObservedPaths:
    """What a recipe run did, recorded by :func:`observed_paths`: the update's training layouts and the engine's
    sampling calls."""

    def __init__(self) -> None:
        self.layouts: Counter = Counter()  # layout name -> update forwards that ran it
        self.fallbacks: Counter = Counter()  # why a forward ran one row per sequence -> forwards
        self.engine: Counter = Counter()  # sampling calls per path
        self.compactions = 0
        self.fixed_caches = 0  # decodes moved to a fixed-shape cache for the compiled step

    def summary(self) -> Dict[str, Any]:
        """``training_layout``: the layouts of the update's forwards (``one row per sequence`` with its reasons);
        ``engine``: the paths that sampled, and how many times finished rows were compacted out."""
        layouts = dict(self.layouts)
        if self.fallbacks:
            layouts["one row per sequence"] = sum(self.fallbacks.values())
        return {"training_layout": sorted(layouts), "update_forwards": layouts,
                "fallback_reasons": sorted(self.fallbacks), "engine": sorted(self.engine),
                "sampling_calls": dict(self.engine), "compactions": self.compactions}


def _fallback_reason(batch: Any, model: Any, allow_layout: bool) -> str:
    """Why :meth:`TrainingBatch.layout_for` gave no layout: the model's reason first (the recipe then asks for
    none: ``training_layout`` turned the default off), else the batch's or the call's."""
    from torchtune_grpo.training.batch import shared_prompt_unsupported

    reason = shared_prompt_unsupported(model)
    if reason is not None:
        return reason
    if not (batch.share_prompt or batch.pack):
        return "no layout asked for (share_prompt_in_training and pack_sequences_in_training off)"
    if not allow_layout:
        return "the caller asked for one row per sequence"
    return "a row longer than the model's max_seq_len"


@contextmanager
def observed_paths() -> Iterator[ObservedPaths]:
    """Inside: record the layout of every gradient-taking forward of :meth:`TrainingBatch.logprobs` (the update's;
    old and reference logprobs run without gradients) and every sampling call of the engines (the native engine
    on transformers' cache with its ``share_prefill``/``compact_decode``, ``HFRollout.compact`` calls, and
    transformers' ``generate``). The wrapped functions compute exactly what they did."""
    from torchtune_grpo.generation import _hf_rollout, _native, _transformers
    from torchtune_grpo.training.batch import TrainingBatch

    seen = ObservedPaths()
    logprobs, hf_cache = TrainingBatch.logprobs, _native.sample_with_hf_cache
    compact, generate = _hf_rollout.HFRollout.compact, _transformers.sample_with_generate
    fix = _hf_rollout.HFRollout.fix

    def spy_logprobs(self, model, rows, **kw):
        if torch.is_grad_enabled():
            allow = kw.get("allow_layout", True)
            lay = self.layout_for(model, rows, allow)
            if lay is None:
                seen.fallbacks[_fallback_reason(self, model, allow)] += 1
            else:
                seen.layouts[_LAYOUT_NAMES.get(type(lay).__name__, type(lay).__name__)] += 1
        return logprobs(self, model, rows, **kw)

    def spy_hf_cache(engine, *a, **kw):
        fixed = seen.fixed_caches
        out = hf_cache(engine, *a, **kw)
        prefill = "prefill once per group" if engine.share_prefill else "prefill every row"
        if seen.fixed_caches > fixed:  # the decode moved to a fixed-shape cache (HFRollout.fix): one compiled call
            decode = "compiled decode on a fixed-shape cache"
        else:
            decode = "compaction" if engine.compact_decode else "no compaction"
        seen.engine[f"native engine on transformers' cache: {prefill} + {decode}"] += 1
        return out

    def spy_compact(self, *a, **kw):
        seen.compactions += 1
        return compact(self, *a, **kw)

    def spy_fix(self, *a, **kw):
        seen.fixed_caches += 1
        return fix(self, *a, **kw)

    def spy_generate(*a, **kw):
        seen.engine["transformers' generate"] += 1
        return generate(*a, **kw)

    TrainingBatch.logprobs, _native.sample_with_hf_cache = spy_logprobs, spy_hf_cache
    _hf_rollout.HFRollout.compact, _transformers.sample_with_generate = spy_compact, spy_generate
    _hf_rollout.HFRollout.fix = spy_fix
    try:
        yield seen
    finally:
        TrainingBatch.logprobs, _native.sample_with_hf_cache = logprobs, hf_cache
        _hf_rollout.HFRollout.compact, _transformers.sample_with_generate = compact, generate
        _hf_rollout.HFRollout.fix = fix


def observed_recipe(name: str, device: torch.device, args: argparse.Namespace, errors: List[Dict[str, str]],
                    label: Optional[str] = None, spies: Any = None) -> "tuple[ObservedPaths, Optional[Dict[str, Any]]]":
    """gpu_grpo's recipe on ``name``'s directory with its paths observed (:func:`observed_paths`, plus ``spies(seen)``,
    a context manager recording more into it). A run that raises is appended to ``errors``; on CUDA with a compiled
    decode it is repeated decoding eagerly (marked ``eager_fallback``), so the stage still times the layouts and the
    step. Returns the paths seen and the recipe's result (None when it raised)."""
    label = label or f"recipe {name}"
    passes = [(label, args)]
    if args.compile_decode is not False and device.type == "cuda":
        passes.append((f"{label} (eager decode)", argparse.Namespace(**{**vars(args), "compile_decode": False})))
    for i, (part, run_args) in enumerate(passes):
        print(f"=== {part}", flush=True)
        out_dir = tempfile.mkdtemp(prefix=f"gpu_hf_recipe_{name}_")
        with observed_paths() as seen, (spies(seen) if spies is not None else nullcontext()):
            try:
                out = gpu_grpo.run_recipe(name, device, run_args, out_dir)
            except Exception as e:  # noqa: BLE001 - report it, and go on (eagerly, or to the other side)
                traceback.print_exc()
                errors.append({"part": part, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-3000:]})
                continue
        print(json.dumps({k: v for k, v in out.items() if k != "all_steps"}, default=str), flush=True)
        if i:
            out["eager_fallback"] = True
        return seen, out
    return seen, None


def run(args: argparse.Namespace, shape: Optional[str] = None, recipe_config: str = RECIPE_CONFIG,
        layouts_shape: Optional[str] = None) -> Dict[str, Any]:
    """Our recipe, then on ``layouts_shape`` (if given), then TRL on one random directory (``shape``, default this
    stage's; benchmarks/gpu_moe.py passes its own shape and config), as the module docstring says."""
    shape = shape or (TINY_SHAPE if args.tiny else SHAPE)
    result: Dict[str, Any] = {"model": shape, "config": recipe_config, "device": args.device, "errors": [],
                              "skipped": None, "paths": {}}
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

    def recipe(name: str) -> Optional[Dict[str, Any]]:
        """The recipe on ``name``'s directory, and what its update and engine did (``result["paths"]``)."""
        seen, out = observed_recipe(name, device, args, result["errors"])
        result["paths"][name] = seen.summary()
        print(json.dumps({name: result["paths"][name]}), flush=True)
        return out

    directory = gpu_grpo.model_dir(shape)
    result["backend"] = chosen_backend(directory)
    result["recipe"] = recipe(shape)
    if layouts_shape is not None:
        register(layouts_shape, recipe_config)
        result["layouts_model"] = {"model": layouts_shape,
                                   "backend": chosen_backend(gpu_grpo.model_dir(layouts_shape))}
        result["layouts_model"]["recipe"] = recipe(layouts_shape)
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
    parser.add_argument("--compile-decode", default="auto", choices=["auto", "on", "off"],
                        help="the native engine's compile_decode: auto compiles each decode step on CUDA only (one "
                             "call on a fixed-shape transformers cache); a compiled run that raises is rerun eagerly")
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
    # auto (None): the engine's default, compiled on CUDA where the family's cache allows it (Qwen3.5's Gated
    # DeltaNet and Gemma 3's windows do; a mixture of experts recording routes decodes eagerly, and says why)
    args.compile_decode = {"auto": None, "on": True, "off": False}[args.compile_decode]
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args(argv)
    finish_args(args)
    return report(run(args, layouts_shape=TINY_LAYOUTS_SHAPE if args.tiny else LAYOUTS_SHAPE), args)


def report(result: Dict[str, Any], args: argparse.Namespace) -> int:
    """Print a stage's result (without the per-side details), write it whole to ``--json``; the exit code."""
    print(json.dumps({k: v for k, v in result.items() if k not in ("recipe", "trl", "layouts_model")}, default=str),
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
