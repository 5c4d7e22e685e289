"""The reference model in less memory (``reference:``): its bytes, its effect on the KL term and the loss, and
the step time, per mode, on SmolLM2-135M-Instruct (or the tiny model).

Modes: ``compute`` (today's full copy in the run's compute dtype, fp32 here), ``bf16``, ``int8``, ``nf4`` and
``nf4+offload`` (NF4 layers in CPU memory streamed to the device; on a CPU-only machine the "device" is the
CPU, so offloading saves nothing there and this row measures only its overhead).

1. ``_rollouts`` child: the recipe (the learning benchmark's SmolLM2 task and settings, ``kl_coef`` 0.04,
   full reference) trains ``--train-steps`` steps, so the policy has moved away from the reference, then
   samples and scores one more batch and writes it with the policy's logprobs and advantages.
2. ``_mode M`` child, one per mode, in a fresh process: loads the initial weights, builds the reference in
   mode ``M`` (:func:`~torchtune_grpo.runtime.reference_setup.build_reference`) and computes its logprobs of
   that batch in the recipe's layout. Memory, two ways: the reference's own bytes (parameters + buffers, by
   device and dtype: :func:`~torchtune_grpo.runtime.reference_setup.module_bytes`), and the process's RSS:
   resident after building minus before, and the peak during building + one logprob pass (sampled every
   10 ms) minus before.
3. The parent compares each mode with ``compute`` on the same tokens: ``|log pi_ref|`` and per-token k3
   differences (mean and max over response tokens) and the loss (``GRPOLoss``, token-mean, at the policy's
   own logprobs: ratio 1), with the ``kl`` metric each would log.
4. ``_steps M`` child, one per mode: the recipe from the initial weights, ``--timed-steps`` steps; the mean
   ``time/step`` and ``time/train`` of the steps after the first.

    python benchmarks/reference_memory.py --model-dir /tmp/smollm2-135m --out results/reference_memory
    python benchmarks/reference_memory.py --model tiny --out results/reference_memory_tiny

Outputs: ``reference_memory.json`` and ``report.md`` (the tables of docs/algorithms.md).
The learning comparison (30 steps, full vs NF4 reference, ``kl_coef`` 0.04, seed by seed) is the learning
benchmark run twice, ``learning_vs_trl.py --sides ours --ours-override kl_coef=0.04 reference.precision=MODE``,
then ``--learning FULL_OUT NF4_OUT`` here (``learning.md``, ``learning.png``; docs/benchmarks/reference_memory.md
has the commands).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from harness import recipe_module, RssSampler, run_child

MODES = ("compute", "bf16", "int8", "nf4", "nf4+offload")
KL_COEF = 0.04  # GRPO's beta (Shao et al. 2024)
TINY_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "full_grpo_cpu.yaml"


def recipe_cfg(model: str, out: Path, mode: str, steps: int) -> Any:
    """The recipe config: the learning benchmark's SmolLM2 task (``model`` its directory) or the tiny config."""
    from omegaconf import OmegaConf

    precision, _, offload = mode.partition("+")
    if model == "tiny":
        from torchtune_grpo.assets import register_resolvers

        register_resolvers()  # ${grpo_asset:...}
        cfg = OmegaConf.load(TINY_CONFIG)
        cfg.output_dir = str(out)
        cfg.save_every_n_steps = None
    else:
        import learning_vs_trl

        task = out.parent / "task"
        cfg = OmegaConf.create(learning_vs_trl.recipe_config(
            Path(model), task / "train_order.jsonl", out, seed=0, steps=steps
        ))
    cfg.max_steps = steps
    cfg.kl_coef = KL_COEF
    cfg.reference = {"precision": precision, "offload": offload == "offload"}
    return cfg


def run_rollouts(model: str, out: Path, train_steps: int) -> None:
    """Child: train ``train_steps`` steps, then one batch: its tokens, the policy's logprobs, advantages."""
    import torch

    cfg = recipe_cfg(model, out / "train", "compute", train_steps + 1)
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.optimizer.zero_grad(set_to_none=True)
    for _ in range(train_steps):
        recipe.train_step()
    step = recipe.step
    generated, _ = step.rollouts.collect(recipe.model, None)
    trained = generated.select(step.dynamic.select(generated, step.batch_size).indices)
    exp, _ = step.build_experience(recipe.model, trained)
    policy = step.build_experience.planned_logprobs(recipe.model, exp.batch)
    torch.save({
        "prompt_ids": trained.prompt_ids, "response_ids": trained.response_ids, "mask": exp.mask.cpu(),
        "advantages": exp.advantages.cpu(), "policy_logprobs": policy.cpu(), "pad_id": recipe.tokenizer.pad_id,
        "share_prompt": step.build_experience.share_prompt,
    }, out / "rollouts.pt")
    recipe.cleanup()


def run_mode(model: str, out: Path, mode: str) -> None:
    """Child: the reference in ``mode``: its bytes, RSS, build and logprob seconds, and its logprobs."""
    import torch
    from torchtune import config, training

    from torchtune_grpo.runtime.model_setup import Placement
    from torchtune_grpo.runtime.precision import Precision
    from torchtune_grpo.runtime.reference_setup import build_reference, module_bytes, ReferenceOptions
    from torchtune_grpo.training.batch import batch_logprobs, TrainingBatch
    import psutil

    cfg = recipe_cfg(model, out / f"mode_{mode}", mode, 1)
    batch = torch.load(out / "rollouts.pt", weights_only=False)
    state = config.instantiate(cfg.checkpointer).load_checkpoint()[training.MODEL_KEY]
    # safetensors maps the checkpoint lazily: copy it into memory now, so that the RSS deltas below are the
    # reference's and not the checkpoint's pages being read in.
    state = {k: v.clone() for k, v in state.items()}
    placement = Placement(torch.device("cpu"), 1, Precision.from_name(cfg.dtype))
    precision, _, offload = mode.partition("+")
    options = ReferenceOptions(precision, offload == "offload")
    max_len = cfg.max_prompt_length + cfg.max_response_length
    layout = TrainingBatch(batch["prompt_ids"], batch["response_ids"], batch["pad_id"], share_prompt=batch["share_prompt"])
    before = psutil.Process().memory_info().rss
    with RssSampler(0.01) as sampler:
        t0 = time.perf_counter()
        reference = build_reference(cfg.model, state, placement, options, source="benchmark", max_len=max_len)
        built = time.perf_counter() - t0
        resident = psutil.Process().memory_info().rss
        seconds = []
        for _ in range(2):  # the first pass warms the kernels; both reported
            t0 = time.perf_counter()
            logprobs = batch_logprobs(reference, layout, micro_batch_size=len(layout), temperature=1.0)
            seconds.append(time.perf_counter() - t0)
    by_dtype = {f"{d}/{t}": n for (d, t), n in sorted(module_bytes(reference).items())}
    torch.save(logprobs.cpu(), out / f"ref_{mode}.pt")
    (out / f"mode_{mode}.json").write_text(json.dumps({
        "mode": mode, "description": options.describe(placement.precision.compute_dtype),
        "bytes": by_dtype, "bytes_total": sum(by_dtype.values()), "rss_resident_delta": resident - before,
        "rss_peak_delta": sampler.peak - before, "build_seconds": built, "logprob_seconds": seconds,
    }))


def run_steps(model: str, out: Path, mode: str, steps: int) -> None:
    """Child: ``steps`` recipe steps from the initial weights with the reference in ``mode``."""
    cfg = recipe_cfg(model, out / f"steps_{mode}", mode, steps)
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.optimizer.zero_grad(set_to_none=True)
    records = [recipe.train_step().metrics for _ in range(steps)]
    recipe.cleanup()
    (out / f"steps_{mode}.json").write_text(json.dumps([
        {k: r[k] for k in ("time/step", "time/train", "time/generation", "kl", "loss")} for r in records
    ]))


def compare(out: Path, modes: List[str]) -> Dict[str, Dict[str, float]]:
    """Each mode against ``compute`` on the same tokens: logprob, k3, ``kl`` metric and loss differences."""
    import torch

    from torchtune_grpo.loss import GRPOLoss, kl_estimate

    batch = torch.load(out / "rollouts.pt", weights_only=False)
    mask, pi, adv = batch["mask"], batch["policy_logprobs"], batch["advantages"]
    loss_fn = GRPOLoss(epsilon=0.2, kl_coef=KL_COEF, loss_agg_mode="token-mean")
    full = torch.load(out / "ref_compute.pt").double()

    def terms(ref: torch.Tensor) -> Any:
        k3 = kl_estimate(pi.double(), ref, "k3", mask=mask)
        loss = loss_fn(pi, pi, adv, mask, ref_logprobs=ref.float(), num_tokens=int(mask.sum()), num_seqs=len(mask))
        return k3, float(loss.loss)

    k3_full, loss_full = terms(full)
    rows = {}
    for mode in modes:
        ref = torch.load(out / f"ref_{mode}.pt").double()
        k3, loss = terms(ref)
        dlp, dk3 = (ref - full).abs()[mask], (k3 - k3_full).abs()[mask]
        rows[mode] = {
            "logprob_abs_diff_mean": float(dlp.mean()), "logprob_abs_diff_max": float(dlp.max()),
            "k3_abs_diff_mean": float(dk3.mean()), "k3_abs_diff_max": float(dk3.max()),
            "kl_metric": float(k3[mask].mean()), "loss": loss, "loss_abs_diff": abs(loss - loss_full),
            "tokens": int(mask.sum()),
        }
    return rows


def report(model: str, results: Dict[str, Any]) -> str:
    """The Markdown tables."""
    mib = 1 / 2**20
    lines = [f"Model: {model}; {results['machine']}", "",
             "| mode | reference bytes (params + buffers) | by dtype | RSS resident delta | RSS peak delta | "
             "build s | logprob pass s (cold, warm) | step s | train s |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, m in results["modes"].items():
        dtypes = ", ".join(f"{k.split('/')[1]} {v * mib:.1f}" for k, v in m["bytes"].items())
        st = results["steps"].get(mode, {})
        lines.append(
            f"| {mode} | {m['bytes_total'] * mib:.1f} MiB | {dtypes} | {m['rss_resident_delta'] * mib:.0f} MiB | "
            f"{m['rss_peak_delta'] * mib:.0f} MiB | {m['build_seconds']:.1f} | "
            f"{m['logprob_seconds'][0]:.2f}, {m['logprob_seconds'][1]:.2f} | {st.get('step', float('nan')):.2f} | "
            f"{st.get('train', float('nan')):.2f} |"
        )
    lines += ["", f"Against the full-precision reference on the same {next(iter(results['compare'].values()))['tokens']}"
              " response tokens (policy after the training steps; GRPOLoss token-mean, ratio 1, kl_coef 0.04):", "",
              "| mode | mean / max abs diff log pi_ref | mean / max abs diff k3 | kl metric | loss | abs diff loss |",
              "|---|---|---|---|---|---|"]
    for mode, c in results["compare"].items():
        lines.append(
            f"| {mode} | {c['logprob_abs_diff_mean']:.2e} / {c['logprob_abs_diff_max']:.2e} | "
            f"{c['k3_abs_diff_mean']:.2e} / {c['k3_abs_diff_max']:.2e} | {c['kl_metric']:.3e} | {c['loss']:.6e} | "
            f"{c['loss_abs_diff']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def learning_report(full_dir: Path, nf4_dir: Path, out: Path) -> str:
    """The learning comparison: two ``learning_vs_trl.py --sides ours`` output directories (full and NF4
    reference, the same seeds) -> ``learning.md`` and ``learning.png`` in ``out`` (held-out accuracy, the
    ``kl`` metric and the training reward per step, per seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {"full reference": full_dir, "NF4 reference": nf4_dir}
    runs = {name: {r["seed"]: r for r in json.loads((d / "runs.json").read_text())} for name, d in arms.items()}
    seeds = sorted(set.intersection(*(set(r) for r in runs.values())))
    kl = {name: {seed: [json.loads(line)["kl"] for line in
                        (arms[name] / f"ours_seed{seed}" / "ours_out" / "metrics.jsonl").read_text().splitlines()]
                 for seed in seeds} for name in arms}
    steps = sorted({e["step"] for r in runs["full reference"].values() for e in r["evals"]})
    lines = [f"Seeds {seeds}; held-out greedy accuracy (64 problems) by step, full / NF4 reference:", "",
             "| step | " + " | ".join(f"seed {s}" for s in seeds) + " | mean over seeds |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for step in steps:
        cells, per_arm = [], {a: [] for a in arms}
        for seed in seeds:
            acc = [next(e["accuracy"] for e in runs[a][seed]["evals"] if e["step"] == step) for a in arms]
            for a, v in zip(arms, acc):
                per_arm[a].append(v)
            cells.append(f"{acc[0]:.3f} / {acc[1]:.3f}")
        cells.append(" / ".join(f"{statistics.fmean(v):.3f}" for v in per_arm.values()))
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "The `kl` metric (token mean of k3 to the reference) and the training reward, mean over steps 1-10, "
              "11-20, 21-30, full / NF4:", "", "| seed | kl 1-10 | kl 11-20 | kl 21-30 | reward 1-10 | reward 11-20 | "
              "reward 21-30 | seconds (process) |", "|---|---|---|---|---|---|---|---|"]
    for seed in seeds:
        row = [str(seed)]
        for key in ("kl", "reward"):
            for first in (1, 11, 21):
                vals = []
                for a in arms:
                    series = kl[a][seed] if key == "kl" else [s["reward"] for s in runs[a][seed]["steps"]]
                    vals.append(statistics.fmean(series[first - 1:first + 9]))
                row.append(f"{vals[0]:.4f} / {vals[1]:.4f}")
        row.append(" / ".join(f"{runs[a][seed]['process_seconds']:.0f}" for a in arms))
        lines.append("| " + " | ".join(row) + " |")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for a, style in zip(arms, ("-", "--")):
        for seed in seeds:
            evals = runs[a][seed]["evals"]
            axes[0].plot([e["step"] for e in evals], [e["accuracy"] for e in evals], style, label=f"{a}, seed {seed}")
            axes[1].plot(range(1, len(kl[a][seed]) + 1), kl[a][seed], style, label=f"{a}, seed {seed}")
            axes[2].plot([s["step"] for s in runs[a][seed]["steps"]], [s["reward"] for s in runs[a][seed]["steps"]],
                         style, label=f"{a}, seed {seed}")
    for ax, title in zip(axes, ("held-out greedy accuracy", "kl (k3 to the reference)", "training reward")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.suptitle("GRPO on SmolLM2-135M-Instruct, kl_coef 0.04: full vs NF4 reference")
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=80)
    text = "\n".join(lines) + "\n"
    (out / "learning.md").write_text(text)
    return text


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--model-dir", default=None, help="SmolLM2 HF directory (built here from the GGUF if absent)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--train-steps", type=int, default=5, help="steps before the compared batch")
    parser.add_argument("--timed-steps", type=int, default=3, help="recipe steps per mode for the step time (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per child (1: see docs/benchmarks/README.md)")
    parser.add_argument("--out", default="reference_memory_results")
    parser.add_argument("--skip-rollouts", action="store_true", help="reuse OUT/rollouts.pt of an earlier run")
    parser.add_argument("--learning", nargs=2, default=None, metavar=("FULL_OUT", "NF4_OUT"),
                        help="only the learning comparison of two learning_vs_trl.py output directories")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.learning:
        print(learning_report(Path(args.learning[0]), Path(args.learning[1]), out))
        return
    model = "tiny"
    if args.model == "smollm2":
        import learning_vs_trl
        from smollm2 import prepare_smollm2

        model_dir = prepare_smollm2(Path(args.model_dir or out / "smollm2-135m").resolve())
        learning_vs_trl.build_task(model_dir, out / "task")
        learning_vs_trl.write_seed_order(out / "task", 0, out / "task")
        model = str(model_dir)
    modes = ["compute"] + [m for m in args.modes if m != "compute"]
    me = Path(__file__).resolve()
    t0 = time.perf_counter()
    if not args.skip_rollouts:
        run_child(sys.executable, me, ["_rollouts", model, str(out), str(args.train_steps)], threads=args.threads,
                  log=out / "rollouts.log")
        print(f"rollouts after {args.train_steps} steps: {time.perf_counter() - t0:.0f} s", flush=True)
    results: Dict[str, Any] = {"modes": {}, "steps": {}, "machine": machine(args.threads)}
    for mode in modes:
        run_child(sys.executable, me, ["_mode", model, str(out), mode], threads=args.threads, log=out / "modes.log")
        results["modes"][mode] = json.loads((out / f"mode_{mode}.json").read_text())
        print(mode, results["modes"][mode], flush=True)
    results["compare"] = compare(out, modes)
    for mode in modes if args.timed_steps > 0 else []:
        run_child(sys.executable, me, ["_steps", model, str(out), mode, str(args.timed_steps)], threads=args.threads,
                  log=out / "steps.log")
        recs = json.loads((out / f"steps_{mode}.json").read_text())[1:] or json.loads((out / f"steps_{mode}.json").read_text())
        results["steps"][mode] = {"step": statistics.fmean(r["time/step"] for r in recs),
                                  "train": statistics.fmean(r["time/train"] for r in recs)}
        print(mode, results["steps"][mode], flush=True)
    results["machine"] = machine(args.threads)  # the load at the end too
    (out / "reference_memory.json").write_text(json.dumps(results, indent=1))
    text = report("SmolLM2-135M-Instruct" if args.model == "smollm2" else "tiny Qwen2 (2 layers, 128 wide)", results)
    (out / "report.md").write_text(text)
    print(text)
    print(f"{time.perf_counter() - t0:.0f} s")


def machine(threads: int) -> str:
    """The machine line of the report: CPU, threads, load."""
    import platform

    return (f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {threads} threads per child, "
            f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("_rollouts", "_mode", "_steps"):
        mode_args = sys.argv[2:]
        if sys.argv[1] == "_rollouts":
            run_rollouts(mode_args[0], Path(mode_args[1]), int(mode_args[2]))
        elif sys.argv[1] == "_mode":
            run_mode(mode_args[0], Path(mode_args[1]), mode_args[2])
        else:
            run_steps(mode_args[0], Path(mode_args[1]), mode_args[2], int(mode_args[3]))
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (the process group); results are written
    else:
        main()
