"""The GPU check's report (scripts/gpu_check.sh): the environment, then one JSON + one markdown file.

    python scripts/gpu_report.py env DIR       # DIR/env.json: device, versions, where each package came from
    python scripts/gpu_report.py report DIR    # DIR/gpu_check.json and DIR/gpu_check.md from what DIR holds

``report`` reads what the check's stages left in DIR (any may be missing: a stage that did not finish is
reported as such): ``env.json``, ``stages.jsonl`` (one line per stage: name, exit status, seconds),
``gpu_tests.xml`` (pytest's JUnit XML, with the figures the tests recorded as properties),
``grpo_*.json`` (benchmarks/gpu_grpo.py), ``trl.json`` (benchmarks/gpu_trl.py), ``ablation.json``
(benchmarks/gpu_ablation.py: the update's switches; with the recipe's generation and reward seconds of the
same shape, when the check measured them, each variant's whole-step MFU), ``qwen3_5.json``
(benchmarks/gpu_qwen3_5.py: the transformers backend and TRL on the Qwen3.5 shape, the recipe on a family that
takes the training layouts, and each run's observed training layout and engine path), ``backends.json``
(benchmarks/gpu_backends.py: the recipe on one model with each policy backend, the ratios) and ``moe.json``
(benchmarks/gpu_moe.py: the same on the scaled-down Qwen3-30B-A3B, with the paper estimate of our peak). Its exit status is 0
only when every stage exited 0, every GPU test passed, and no benchmark part raised.
"""

import glob
import importlib
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional

PACKAGES = ["torch", "torchtune", "torchao", "torchdata", "omegaconf", "datasets", "transformers", "trl",
            "peft", "accelerate", "safetensors", "tokenizers", "pyarrow", "numpy", "torchtune_grpo"]


def env_info() -> Dict[str, Any]:
    """Python, the device, and each package's version and the directory it was imported from."""
    import torch

    info: Dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, device_memory_gib=props.total_memory / 2**30,
                    multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    else:
        info["device"] = "cpu"
    packages = {}
    for name in PACKAGES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a package that does not import is a finding, not a crash
            packages[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        version = getattr(mod, "__version__", None)
        packages[name] = {"version": str(version) if version else None,
                          "from": str(Path(mod.__file__).resolve().parent.parent) if getattr(mod, "__file__", None) else None}
    info["packages"] = packages
    return info


def parse_junit(path: Path) -> List[Dict[str, Any]]:
    """Each test case of a JUnit XML file: name, outcome, seconds, recorded properties, failure text."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "") + "\n" + (el.text or "")
        props = {p.get("name"): _number(p.get("value")) for p in case.iter("property")}
        cases.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "figures": props, "message": message.strip()[-2000:]})
    return cases


def _number(value: Optional[str]) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _read_json(path: Path) -> Optional[Any]:
    return json.loads(path.read_text()) if path.is_file() else None


def build_report(directory: Path) -> Dict[str, Any]:
    """Everything the stages left in ``directory``, plus the verdict and the TRL step-time ratio."""
    stages = []
    if (directory / "stages.jsonl").is_file():
        stages = [json.loads(line) for line in (directory / "stages.jsonl").read_text().splitlines() if line.strip()]
    tests = parse_junit(directory / "gpu_tests.xml") if (directory / "gpu_tests.xml").is_file() else None
    grpo = [_read_json(Path(p)) for p in sorted(glob.glob(str(directory / "grpo_*.json")))]
    grpo = [g for g in grpo if g]
    trl = _read_json(directory / "trl.json")
    ablation = _read_json(directory / "ablation.json")
    problems = [f"stage {s['name']} exited {s['rc']}" + (" (time limit)" if s.get("timed_out") else "")
                for s in stages if s["rc"] != 0]
    if tests is not None:
        problems += [f"test {t['name']} {t['outcome']}" for t in tests if t["outcome"] != "passed"]
        if not tests:
            problems.append("no GPU test ran")
    elif not stages or "tests" in {s["name"] for s in stages}:  # a check run without the stage (--stages) has none
        problems.append("no GPU test results (gpu_tests.xml)")
    for g in grpo:
        problems += [f"gpu_grpo {e['part']}: {e['error']}" for e in g.get("errors", [])]
    if ablation:
        problems += [f"gpu_ablation {e['part']}: {e['error']}" for e in ablation.get("errors", [])]
        _whole_step_mfu(ablation, grpo)
    qwen3_5 = _read_json(directory / "qwen3_5.json")
    problems += [f"gpu_qwen3_5 {e['part']}: {e['error']}" for e in (qwen3_5 or {}).get("errors", [])]
    moe = _read_json(directory / "moe.json")
    problems += [f"gpu_moe {e['part']}: {e['error']}" for e in (moe or {}).get("errors", [])]
    backends = _read_json(directory / "backends.json")
    problems += [f"gpu_backends {e['part']}: {e['error']}" for e in (backends or {}).get("errors", [])]
    report: Dict[str, Any] = {"env": _read_json(directory / "env.json"), "stages": stages, "tests": tests,
                              "grpo": grpo, "trl": trl, "ablation": ablation, "qwen3_5": qwen3_5, "moe": moe,
                              "backends": backends,
                              "problems": problems, "ok": not problems}
    ours = _recipe_step(grpo, trl["model"]) if trl else None
    if ours and trl.get("median_step_s"):
        report["ours_vs_trl"] = {"model": trl["model"], "ours_step_s": ours, "trl_step_s": trl["median_step_s"],
                                 "ratio": ours / trl["median_step_s"]}
    return report


def _whole_step_mfu(ablation: Dict[str, Any], grpo: List[Dict[str, Any]]) -> None:
    """Each variant's MFU over a whole step: 6 N tokens over the recipe's generation + reward seconds of the
    same shape and batch (gpu_grpo.py's recipe part, when it ran) plus the variant's update step."""
    for r in ablation.get("ablation", []):
        recipe = next((x for g in grpo for x in g.get("recipe", []) if x["model"] == r.get("model")), None)
        peak = (ablation.get("ceilings") or {}).get("matmul_bf16_tflops")
        if recipe is None or not peak or "flop_params" not in r:
            continue
        m = recipe["median"]
        rest = (m.get("time/generation") or 0.0) + (m.get("time/reward") or 0.0)
        step = rest + r["median"]["step_s"]
        r["whole_step"] = {"generation_reward_s": rest, "step_s": step,
                           "mfu_step": 6 * r["flop_params"] * r["tokens"] / step / (peak * 1e12)}


def _recipe_step(grpo: List[Dict[str, Any]], shape: str) -> Optional[float]:
    """Our recipe's median step time on ``shape`` (its --tiny stand-in included), if measured."""
    for g in grpo:
        for r in g.get("recipe", []):
            if r["model"] == shape:
                return r["median"].get("time/step")
    return None


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:,.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return "" if x is None else str(x)


def markdown(report: Dict[str, Any]) -> str:
    """The report as markdown: verdict, environment, stages, tests with their figures, benchmark tables."""
    env = report.get("env") or {}
    lines = [f"# GPU check: {'OK' if report['ok'] else 'NOT OK'}", ""]
    if env:
        lines += [f"Device: **{env.get('device')}**" + (f" ({env['device_memory_gib']:.0f} GiB)" if env.get("device_memory_gib") else "")
                  + f"; Python {env.get('python')}; CUDA {env.get('torch_cuda')}; {env.get('cpus')} CPUs.", "",
                  "| package | version | imported from |", "|---|---|---|"]
        for name, p in env.get("packages", {}).items():
            lines.append(f"| {name} | {p.get('version') or p.get('error', '')} | {p.get('from') or ''} |")
        lines.append("")
    if report["problems"]:
        lines += ["Problems:", ""] + [f"- {p}" for p in report["problems"]] + [""]
    lines += ["| stage | exit | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['rc']}{' (time limit)' if s.get('timed_out') else ''}"
              f"{' (skipped: ' + s['skipped'] + ')' if s.get('skipped') else ''} | {s['seconds']:.0f} |"
              for s in report["stages"]]
    lines.append("")
    if report["tests"] is not None:
        lines += ["## GPU tests (`pytest -m gpu`)", "", "| test | outcome | seconds | figures |", "|---|---|---|---|"]
        for t in report["tests"]:
            figs = ", ".join(f"{k} = {_fmt(v)}" for k, v in t["figures"].items())
            lines.append(f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} | {figs} |")
        lines.append("")
    for g in report["grpo"]:
        lines += _grpo_tables(g)
    if report.get("ablation"):
        lines += _ablation_table(report["ablation"])
    trl = report.get("trl")
    if trl:
        lines += ["## TRL GRPOTrainer", "",
                  f"TRL {trl['trl']}, {trl['model']}, {trl['prompts']} prompts x {trl['group']} = {trl['rows']} rows, "
                  f"micro-batch {trl['micro_batch']}, {trl['dtype']}: median step {_fmt(trl['median_step_s'])} s, "
                  f"{_fmt(trl['tokens_per_s'])} tokens/s, peak {_fmt(trl.get('peak_allocated_gib'))} GiB.", ""]
    ratio = report.get("ours_vs_trl")
    if ratio:
        lines += [f"**Step time, ours / TRL ({ratio['model']}): {ratio['ratio']:.2f}x** "
                  f"({_fmt(ratio['ours_step_s'])} s / {_fmt(ratio['trl_step_s'])} s).", ""]
    if report.get("qwen3_5"):
        lines += _qwen3_5_section(report["qwen3_5"])
    if report.get("backends"):
        lines += _backends_section(report["backends"])
    if report.get("moe"):
        lines += _moe_section(report["moe"])
    return "\n".join(lines) + "\n"


def _backends_section(b: Dict[str, Any]) -> List[str]:
    """benchmarks/gpu_backends.py: one model, each policy backend, the same workload; the ratios and paths."""
    lines = [f"## One model, both backends ({b['model']})", ""]
    rows = []
    for backend, r in (b.get("runs") or {}).items():
        m = r["median"]
        rows.append(f"| {backend} | {_fmt(m.get('time/step'))} | {_fmt(m.get('time/generation'))} | "
                    f"{_fmt(m.get('time/train'))} | {_fmt(r.get('first_step_s'))} | {_fmt(m.get('tokens_per_second'))} | "
                    f"{_fmt(m.get('memory/peak_allocated_gib'))} |")
    if rows:
        lines += ["| backend | step s | generation s | train s | first step s | tokens/s | peak GiB |",
                  "|---|---|---|---|---|---|---|"] + rows + [""]
    for backend, paths in (b.get("paths") or {}).items():
        layout = ", ".join(paths["training_layout"]) or "no update forward"
        if paths["fallback_reasons"]:
            layout += f" (because {'; '.join(paths['fallback_reasons'])})"
        lines += [f"- {backend}: the update trained in **{layout}**; sampled by "
                  f"**{', '.join(paths['engine']) or 'no engine call'}**.", ""]
    ratio = b.get("transformers_over_torchtune") or {}
    if ratio:
        lines += ["**transformers / torchtune: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()) + "**", ""]
    return lines


def _ablation_table(a: Dict[str, Any]) -> List[str]:
    lines = [f"## The update's switches (benchmarks/gpu_ablation.py, {a.get('device')}, {a.get('dtype')})", "",
             "| model | variant | checkpointed | step s | reference s | update s | warm-up compile s | tokens/s | "
             "MFU update | MFU step | peak GiB | logprob diff mean / max | grad rel. L2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in a.get("ablation", []):
        m, d = r["median"], r.get("vs_baseline") or {}
        diff = f"{_fmt(d['logprob_abs_mean'])} / {_fmt(d['logprob_abs_max'])}" if d else ""
        lines.append(f"| {r['model']} | {r['variant']} | {r['checkpointed_layers']} | {_fmt(m['step_s'])} | "
                     f"{_fmt(m['reference_s'])} | {_fmt(m['update_s'])} | {_fmt(r['warmup']['compile_s'])} | "
                     f"{_fmt(r['tokens_per_s'])} | {_fmt(r.get('mfu_train'))} | "
                     f"{_fmt((r.get('whole_step') or {}).get('mfu_step'))} | {_fmt(r.get('peak_allocated_gib'))} | "
                     f"{diff} | {_fmt(d.get('grad_rel_l2'))} |")
    lines.append("")
    if a.get("skipped"):
        lines += ["Skipped (time budget): " + ", ".join(a["skipped"]), ""]
    return lines


def _moe_section(q: Dict[str, Any]) -> List[str]:
    """benchmarks/gpu_moe.py: the Qwen3.5 stage's table on the mixture of experts, its layout and the paper
    estimate of our peak beside the measured one."""
    lines = _qwen3_5_section(q, title="A mixture of experts through the transformers backend")
    layout, estimate = q.get("layout") or {}, q.get("paper_estimate") or {}
    if layout:
        lines += [f"Layout: Qwen3-30B-A3B's layer, {layout['layers']} of {layout['published_layers']} layers, "
                  f"{layout['experts']} experts, {layout['experts_per_token']} per token; "
                  f"{(estimate.get('parameters') or {}).get('total', 0):,} parameters.", ""]
    if estimate:
        lines += [f"Our peak on paper (benchmarks/moe_memory.py): {_fmt(estimate['peak_gb'])} GB; measured: "
                  f"{_fmt(estimate.get('measured_peak_gb')) or 'no device peak'}"
                  f"{' GB' if estimate.get('measured_peak_gb') else ''}.", ""]
    return lines


def _qwen3_5_section(q: Dict[str, Any], title: str = "Qwen3.5 through the transformers backend") -> List[str]:
    """benchmarks/gpu_qwen3_5.py: the transformers backend on the Qwen3.5 shape, against TRL (or why skipped)."""
    lines = [f"## {title} ({q['model']})", ""]
    if q.get("skipped"):
        return lines + [f"Skipped: {q['skipped']}.", ""]
    backend = q.get("backend") or {}
    lines += [f"transformers {q.get('transformers')}; backend **{backend.get('name')}** ({backend.get('reason')}).", ""]
    for name, paths in (q.get("paths") or {}).items():  # what each recipe run did, observed while it ran
        layout = f"**{', '.join(paths['training_layout']) or 'no update forward'}**"
        if paths["fallback_reasons"]:
            layout += f" (because {'; '.join(paths['fallback_reasons'])})"
        lines += [f"- {name}: the update trained in {layout}; sampled by "
                  f"**{', '.join(paths['engine']) or 'no engine call'}** ({paths['compactions']} compactions).", ""]
    rows = []
    recipe, trl = q.get("recipe"), q.get("trl")
    layouts_model = q.get("layouts_model") or {}
    for label, part in (("ours (recipe)", recipe), (f"ours (recipe, {layouts_model.get('model')})",
                                                    layouts_model.get("recipe"))):
        if not part:
            continue
        m = part["median"]
        rows.append(f"| {label} | {_fmt(m.get('time/step'))} | {_fmt(m.get('time/generation'))} | "
                    f"{_fmt(m.get('time/train'))} | {_fmt(m.get('tokens_per_second'))} | "
                    f"{_fmt(m.get('memory/peak_allocated_gib'))} |")
    if trl:
        rows.append(f"| TRL {trl['trl']} | {_fmt(trl['median_step_s'])} | | | {_fmt(trl['tokens_per_s'])} | "
                    f"{_fmt(trl.get('peak_allocated_gib'))} |")
    if rows:
        lines += ["| side | step s | generation s | train s | tokens/s | peak GiB |", "|---|---|---|---|---|---|"]
        lines += rows + [""]
    for part in q.get("skipped_parts") or []:
        lines += [f"Skipped: {part}.", ""]
    ratio = q.get("ours_vs_trl")
    if ratio:
        lines += [f"**Step time, ours / TRL ({q['model']}, transformers backend): {ratio['ratio']:.2f}x** "
                  f"({_fmt(ratio['ours_step_s'])} s / {_fmt(ratio['trl_step_s'])} s).", ""]
    return lines


def _grpo_tables(g: Dict[str, Any]) -> List[str]:
    lines = [f"## benchmarks/gpu_grpo.py ({', '.join(g.get('argv', []))})", ""]
    c = g.get("ceilings") or {}
    if c:
        lines += [f"Measured ceilings: copy {_fmt(c['copy_gbs'])} GB/s, bf16 matmul {_fmt(c['matmul_bf16_tflops'])} TFLOP/s.", ""]
    if g["decode"]:
        lines += ["| decode | rows | compiled | tokens/s | ms/step | bound tokens/s | of bound |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {d['model']} | {d['rows']} | {d['compiled']} | {_fmt(d['decode_tokens_per_s'])} | "
                  f"{_fmt(d['decode_step_ms'])} | {_fmt(d.get('bound_tokens_per_s'))} | {_fmt(d.get('fraction_of_bound'))} |"
                  for d in g["decode"]]
        lines.append("")
    if g["grpo"]:
        lines += ["| GRPO step | step s | generation s | experience s | train s | tokens/s | peak GiB | MFU train | MFU step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in g["grpo"]:
            m = r["median"]
            lines.append(f"| {r['model']} | {_fmt(m['time_step'])} | {_fmt(m['time_generation'])} | "
                         f"{_fmt(m['time_experience'])} | {_fmt(m['time_train'])} | {_fmt(r['tokens_per_s'])} | "
                         f"{_fmt(r['peak_allocated_gib'])} | {_fmt(r.get('mfu_train'))} | {_fmt(r.get('mfu_step'))} |")
        lines.append("")
    if g["recipe"]:
        lines += ["| recipe | step s | generation s | train s | tokens/s | peak GiB | MFU (6N, step) |", "|---|---|---|---|---|---|---|"]
        for r in g["recipe"]:
            m = r["median"]
            lines.append(f"| {r['model']} | {_fmt(m.get('time/step'))} | {_fmt(m.get('time/generation'))} | "
                         f"{_fmt(m.get('time/train'))} | {_fmt(m.get('tokens_per_second'))} | "
                         f"{_fmt(m.get('memory/peak_allocated_gib'))} | {_fmt(r.get('mfu_step_6n_only'))} |")
        lines.append("")
    for r in g.get("reference", []):
        lines += [f"Reference model ({r['model']}, {r['dtype']}; logprobs of {r['rows']} x {r['length']} tokens):", "",
                  "| reference mode | bytes by device/dtype (GiB) | held GiB | peak GiB | logprob s | "
                  "mean / max abs diff logprob |", "|---|---|---|---|---|---|"]
        for mode, m in r["modes"].items():
            held = ", ".join(f"{k} {v / 2**30:.3f}" for k, v in m["bytes"].items())
            lines.append(f"| {mode} | {held} | {_fmt(m['held_gib'])} | {_fmt(m['peak_gib'])} | {_fmt(m['logprob_s'])} | "
                         f"{_fmt(m['logprob_abs_diff_mean'])} / {_fmt(m['logprob_abs_diff_max'])} |")
        lines.append("")
    if g.get("skipped"):
        lines += ["Skipped (time budget): " + ", ".join(g["skipped"]), ""]
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("env", "report"):
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    if argv[0] == "env":
        (directory / "env.json").write_text(json.dumps(env_info(), indent=1))
        return 0
    report = build_report(directory)
    (directory / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (directory / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
