"""The update's switches one by one and all together: what each computes, how fast, with how much memory.

Each variant builds the policy and the reference as the recipe does (``runtime/model_setup.py``
``build_model`` with a :class:`~torchtune_grpo.runtime.model_setup.Placement` carrying the switches; FSDP2
mixed precision on a one-process group for ``bf16``) and runs the recipe's own experience and update
stages (``ExperienceBuilder``: layout, reference and old logprobs; ``PolicyUpdate``: forward, GRPO loss,
backward, clip, AdamW) on the same fixed rollouts: random prompts, ``--group`` random completions each of
``--response-len`` tokens (no generation: that is the decode's business, measured by gpu_grpo.py).

Variants (``--variants``), each against ``baseline`` (today's CUDA defaults: fp32 head, every layer
checkpointed, eager, TF32 off):

- ``bf16_head``: ``logprob_head: bf16``; ``tf32``: ``tf32: true``; ``no_ac``: ``activation_checkpointing: off``;
  ``selective_ac``: every 2nd layer; ``auto_ac``: ``auto`` (the decision is recorded);
  ``compiled``: ``compile_training`` (``inductor`` on CUDA, ``aot_eager`` on CPU);
  ``all``: ``bf16_head`` + ``tf32`` + ``auto_ac`` + ``compiled``.

For each: seconds per update step (experience + update; the reference, old-logprob and update phases apart;
the warm-up step, which compiles, reported separately), tokens/s, MFU (6 N tokens over the update step's
time, against the measured bf16 matrix rate; 6 N + 2 N for the reference forward over the same time as
``mfu_train_6n_2n``), peak allocated memory, and what the variant computes against the baseline on the
warm-up step from the same weights: per-token ``|logprob - baseline|`` of ``pi_old`` (mean and max over
response tokens), the loss difference, and the first optimizer step's gradient (relative L2 difference and
cosine). The whole step's MFU needs the generation time: scripts/gpu_report.py takes it from the recipe
stage of the same shape.

    python benchmarks/gpu_ablation.py --models qwen3_0_6b --json ablation.json            # a GPU
    python benchmarks/gpu_ablation.py --device cpu --tiny                                 # CPU rehearsal
    python benchmarks/gpu_ablation.py --device cpu --model-path /tmp/smollm2-135m --dtype fp32 \\
        --prompts 2 --group 4 --response-len 32 --variants baseline bf16_head no_ac       # a real model
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

import gpu_grpo  # benchmarks/ is on sys.path: this script's directory
import hf_random

VARIANTS: Dict[str, Dict[str, Any]] = {
    "baseline": {},
    "bf16_head": {"logprob_head": "bf16"},
    "tf32": {"tf32": True},
    "no_ac": {"activation_checkpointing": "off"},
    "selective_ac": {"activation_checkpointing": "selective"},
    "auto_ac": {"activation_checkpointing": "auto"},
    "compiled": {"compile": True},
    "all": {"logprob_head": "bf16", "tf32": True, "activation_checkpointing": "auto", "compile": True},
}


def _init_group(device: torch.device) -> None:
    """A one-process group (FSDP2 mixed precision needs one, as the recipe's one-process runs have)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def _tf32_state() -> Any:
    matmul = torch.backends.cuda.matmul
    return matmul.fp32_precision if hasattr(matmul, "fp32_precision") else matmul.allow_tf32


def _restore_tf32(state: Any) -> None:
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = state
    else:
        matmul.allow_tf32 = state


class _FirstGradients(torch.optim.AdamW):
    """AdamW that keeps a CPU fp32 copy of the gradients of its first step (the comparison's gradient)."""

    def __init__(self, params, keep: bool, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.keep, self.first = keep, None

    def step(self, closure=None):
        if self.keep and self.first is None:
            grads = []
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        grads.append(g.detach().float().flatten().cpu())
            self.first = torch.cat(grads)
        return super().step(closure)


def rollouts(vocab: int, args: argparse.Namespace, seed: int):
    """Fixed rollouts: ``prompts x group`` rows, random prompt and completion ids (no pad or stop id)."""
    from torchtune_grpo.rollouts.groups import RolloutGroups

    pad, stop = hf_random.special_ids(vocab)
    prompts = gpu_grpo.random_prompts(args.prompts, args.min_prompt_len, args.max_prompt_len, vocab, [pad, stop], seed)
    g = args.group
    responses = gpu_grpo.random_prompts(args.prompts * g, args.response_len, args.response_len, vocab, [pad, stop],
                                        seed + 1)
    n = len(responses)
    rewards = torch.tensor(gpu_grpo.even_token_reward(responses), dtype=torch.float32)
    return RolloutGroups(
        group_size=g, prompts=[""] * args.prompts, fields=[{} for _ in range(args.prompts)],
        prompt_ids=[prompts[i // g] for i in range(n)], response_ids=responses, completions=[""] * n,
        truncated=torch.ones(n, dtype=torch.bool), rewards=rewards,
    ), pad


def run_variant(name: str, path: Path, device: torch.device, args: argparse.Namespace,
                baseline: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """One variant: build, one warm-up step (compared with the baseline's), ``--steps`` measured steps."""
    from torchtune_grpo.runtime.compute import set_tf32

    gpu_grpo.free_memory()  # what a failed variant left (its traceback held it) goes before this one starts
    tf32_before = _tf32_state()
    set_tf32(VARIANTS[name].get("tf32", False))  # process-wide: restored whatever happens
    try:
        return _run_variant(name, path, device, args, baseline)
    finally:
        _restore_tf32(tf32_before)
        gpu_grpo.free_memory()


def _run_variant(name: str, path: Path, device: torch.device, args: argparse.Namespace,
                 baseline: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    from torchtune_grpo.loss import GRPOLoss
    from torchtune_grpo.loss.masks import LossMasks
    from torchtune_grpo.metrics.timing import device_clock
    from torchtune_grpo.models import HFCheckpointer
    from torchtune_grpo.models.compiled import compile_seconds
    from torchtune_grpo.models.logprobs import head_matmul_kernel
    from torchtune_grpo.rollouts.advantages import GroupRelativeAdvantage
    from torchtune_grpo.runtime.model_setup import build_model, Placement
    from torchtune_grpo.runtime.precision import Precision
    from torchtune_grpo.training.batch import batch_logprobs
    from torchtune_grpo.training.experience import ExperienceBuilder, Reference
    from torchtune_grpo.training.update import PolicyUpdate

    switches = dict(VARIANTS[name])
    backend = ("inductor" if device.type == "cuda" else "aot_eager") if switches.pop("compile", False) else None
    switches.pop("tf32", None)  # set by run_variant
    max_len = args.max_prompt_len + args.response_len
    default_ac = "on" if args.activation_checkpointing else "off"
    placement = Placement(
        device=device, world_size=1, precision=Precision.from_name(args.dtype),
        activation_checkpointing=switches.get("activation_checkpointing", default_ac),
        checkpoint_every=2, micro_batch_tokens=args.micro_batch * max_len, chunk_size=args.chunk_size,
        logprob_head=switches.get("logprob_head", "fp32"), compile_backend=backend, reference=True,
    )
    model_cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(path)})
    state = HFCheckpointer(str(path), tempfile.mkdtemp(prefix="ablation_ckpt_")).load_checkpoint()["model"]
    policy = build_model(model_cfg, state, placement, trainable=True, source=str(path), max_len=max_len)
    ref = build_model(model_cfg, state, placement, trainable=False, source=str(path), max_len=max_len)
    del state
    layers = list(policy.layers)
    checkpointed = sum("CheckpointWrapper" in type(m).__name__ for m in layers)  # FSDP2 renames the class
    optimizer = _FirstGradients(policy.parameters(), keep=args.check, lr=1e-6, weight_decay=0.0)
    loss_fn = GRPOLoss(epsilon=0.2, kl_coef=0.04, kl_estimator="k3", loss_agg_mode="token-mean")
    mbs, tokens_budget = args.micro_batch, args.micro_batch * max_len
    update = PolicyUpdate(policy, optimizer, loss_fn, micro_batch_size=mbs, max_tokens_per_micro_batch=tokens_budget,
                          clip_grad_norm=1.0, chunk_size=args.chunk_size)
    vocab = policy.tok_embeddings.num_embeddings
    groups, pad = rollouts(vocab, args, seed=0)
    build = ExperienceBuilder(
        advantage=GroupRelativeAdvantage(scale_by_std=True), reward_weights=[1.0], group_size=args.group, pad_id=pad,
        loss_masks=LossMasks(None, None), micro_batch_size=mbs, temperature=1.0, device=device,
        chunk_size=args.chunk_size, max_tokens_per_micro_batch=tokens_budget, kl_coef=0.04, reference=Reference(ref),
    )
    tokens = gpu_grpo.count_tokens(groups.prompt_ids, groups.response_ids)

    def step() -> Dict[str, float]:
        c0, t0 = compile_seconds(), device_clock(device)
        exp, _ = build(policy, groups)
        t1 = device_clock(device)
        stats = update(exp)
        t2 = device_clock(device)
        return {"experience_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0, "compile_s": compile_seconds() - c0,
                "reference_s": exp.seconds["time/reference"], "loss": float(stats.losses["loss"]),
                "grad_norm": float(stats.grad_norm)}

    out: Dict[str, Any] = {"variant": name, "switches": VARIANTS[name], "compile_backend": backend,
                           "checkpointed_layers": f"{checkpointed}/{len(layers)}", "tokens": tokens,
                           "rows": len(groups.response_ids)}
    # pi_old's logprobs on the response tokens from the initial weights (the comparison's logprobs)
    exp0, _ = build(policy, groups)
    with torch.no_grad():
        logprobs = batch_logprobs(policy, exp0.batch, micro_batch_size=mbs, chunk_size=args.chunk_size)
    mask = exp0.mask
    warm = step()
    out["warmup"] = warm
    out["head_kernel"] = head_matmul_kernel(device) if placement.logprob_head == "bf16" else "fp32"
    if args.check:
        out["_logprobs"], out["_grads"], out["_loss"] = logprobs[mask].float().cpu(), optimizer.first, warm["loss"]
        if baseline is not None:
            d = (out["_logprobs"] - baseline["_logprobs"]).abs()
            g, g0 = optimizer.first.double(), baseline["_grads"].double()  # 1e8 terms: fp32 sums drift by %
            out["vs_baseline"] = {
                "logprob_abs_mean": float(d.mean()), "logprob_abs_max": float(d.max()),
                "loss_abs": abs(warm["loss"] - baseline["_loss"]),
                "grad_rel_l2": float((g - g0).norm() / g0.norm()),
                "grad_cosine": float(torch.nn.functional.cosine_similarity(g, g0, dim=0)),
            }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = [step() for _ in range(args.steps)]
    med = {k: gpu_grpo.median([s[k] for s in steps]) for k in steps[0]}
    out.update(median=med, steps=steps, tokens_per_s=tokens / med["step_s"],
               peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    if args.peak_flops:
        n = gpu_grpo.flop_params(policy)
        out["flop_params"] = n
        out["mfu_train"] = 6 * n * tokens / med["step_s"] / args.peak_flops
        out["mfu_train_6n_2n"] = 8 * n * tokens / med["step_s"] / args.peak_flops
    del policy, ref, optimizer, update, build, exp0
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3_0_6b", "qwen3_1_7b"], choices=list(hf_random.SHAPES))
    parser.add_argument("--model-path", default=None, help="a Hugging Face directory instead of --models")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32", "bf16_pure"])
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: the tiny shape and workload")
    hf_random.add_workload_args(parser, steps=2)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the comparison with baseline")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak; default: measured on CUDA")
    parser.add_argument("--model-dir", default=str(gpu_grpo.MODEL_DIR))
    parser.add_argument("--time-budget", type=float, default=None, help="seconds: later variants are skipped")
    parser.add_argument("--json", default=None)
    parser.add_argument("--save-logprobs", default=None,
                        help="torch.save each variant's compared response-token logprobs here (runs of other dtypes)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny:
        args.models = ["tiny_qwen3"]
        hf_random.use_tiny_workload(args)
        args.chunk_size, args.steps = 64, 1
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    gpu_grpo.MODEL_DIR = Path(args.model_dir)
    for name in ("recompile_limit", "cache_size_limit"):  # a graph per variant: stay compiled past 8
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    _init_group(device)
    results: Dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "dtype": args.dtype, "ablation": [], "errors": [], "skipped": []}
    if args.peak_tflops is None and device.type == "cuda":
        results["ceilings"] = gpu_grpo.measure_ceilings(device)
        args.peak_tflops = results["ceilings"].get("matmul_bf16_tflops")
    args.peak_flops = (args.peak_tflops or 0) * 1e12 or None
    started = time.perf_counter()

    def save() -> None:
        if args.json:
            public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results["ablation"]]
            with open(args.json, "w") as f:
                json.dump({**results, "ablation": public}, f, indent=1, default=str)

    targets = [(Path(args.model_path).name, Path(args.model_path))] if args.model_path else \
        [(m, hf_random.write_model_dir(m, gpu_grpo.MODEL_DIR / m,
                                                device="cuda" if device.type == "cuda" else "cpu"))
         for m in args.models]
    for model, path in targets:
        baseline = None
        for name in args.variants:
            label = f"{model} {name}"
            if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                results["skipped"].append(label)
                print(f"=== {label}: skipped (time budget of {args.time_budget:.0f} s spent)", flush=True)
                continue
            print(f"=== {label}", flush=True)
            t0 = time.perf_counter()
            try:
                r = run_variant(name, path, device, args, baseline)
                r.update(model=model, seconds=time.perf_counter() - t0)
                results["ablation"].append(r)
                if name == "baseline":
                    baseline = r
                print(json.dumps({k: v for k, v in r.items() if not k.startswith("_") and k != "steps"},
                                 default=str), flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the other variants
                import traceback

                traceback.print_exc()
                results["errors"].append({"part": label, "error": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc()[-3000:]})
                gpu_grpo.free_memory()
            save()
    save()
    if args.save_logprobs:
        torch.save({f"{r['model']} {r['variant']}": r["_logprobs"] for r in results["ablation"] if "_logprobs" in r},
                   args.save_logprobs)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
