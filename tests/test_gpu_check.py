"""The GPU check (scripts/gpu_check.sh, docs/gpu.md) rehearsed on CPU, so that it cannot rot before a GPU
run: the whole script end to end with ``--device cpu --tiny`` (the carried wheels installed into a site
directory as on the GPU machine, the GPU test set, every benchmark part, TRL, the report), the wheel
bundle against the 64 MiB that can travel, and the report's reading of test and stage outcomes.

The rehearsal runs with ``--fork-stages``: its Python stages are forked from one process that imported the
packages once (scripts/fork_stages.py; each stage's own import took ~7 s, 60 s of the whole), with vLLM hidden
as on the GPU machine, which has none (TRL imports the CPU build this environment has, ~7 s in each of its three
stages). Every stage still runs its own script in its own process; so does the GPU tests' logprob-memory
measurement (its peak RSS), forked from the same server (``GPU_CHECK_PYTHON``) instead of importing for ~3.5 s.

The wheels come from scripts/setup_env.sh (``$VENV/gpu-wheels/{device,rehearsal}``, downloaded by
scripts/gpu_wheels.py); ``GPU_CHECK_WHEELS`` names another folder with those two subfolders.
"""

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_report  # noqa: E402  (scripts/ is not a package)
import gpu_wheels  # noqa: E402

WHEELS = Path(os.environ.get("GPU_CHECK_WHEELS", Path(sys.prefix) / "gpu-wheels"))
GPU_TESTS = {
    "test_bf16_with_fp32_master_weights_moves_at_lr_1e6_and_tracks_fp32",
    "test_compiled_decode_equals_eager_tokens_and_logprobs[fp32]",
    "test_compiled_decode_equals_eager_tokens_and_logprobs[bf16]",
    "test_fsdp2_on_one_device_matches_the_plain_model",
    "test_lora_and_qlora_steps[lora]",
    "test_lora_and_qlora_steps[qlora]",
    "test_chunked_logprobs_peak_memory_is_two_chunk_buffers",
    "test_recipe_checkpoint_loads_in_transformers_with_equal_logits",
    "test_a_generation_worker_on_the_device_samples_what_the_trainer_does",
    "test_multi_turn_sessions_compact_on_the_device",
    "test_packed_rows_flex_attention_equals_the_dense_mask",
    "test_bf16_head_accumulates_in_fp32_on_the_device",
    "test_offloaded_nf4_reference_streams_its_layers_and_computes_the_same",
}


ENGINE_PATH = "native engine on transformers' cache: prefill once per group + compaction"


def assert_stage_paths(stage: dict, md: str) -> None:
    """The Qwen3.5 stage's report (``qwen3_5.json`` and its markdown) names each run's layout and engine path."""
    gemma = stage["layouts_model"]
    assert gemma["model"] == "tiny_gemma3" and gemma["backend"]["name"] == "transformers"
    assert gemma["recipe"]["steps"] == 2
    paths = stage["paths"]
    assert set(paths) == {"tiny_qwen3_5", "tiny_gemma3"}
    for p in paths.values():  # Qwen3.5's Gated DeltaNet layers split by sequence; Gemma 3's windows by position
        assert p["training_layout"] == ["shared prompts"] and p["fallback_reasons"] == []
        assert p["engine"] == [ENGINE_PATH] and p["sampling_calls"][ENGINE_PATH] == 2  # one rollout per step
        assert sum(p["update_forwards"].values()) >= 2  # at least one update forward per step
    assert "- tiny_gemma3: the update trained in **shared prompts**; sampled by **" + ENGINE_PATH in md
    assert "- tiny_qwen3_5: the update trained in **shared prompts**; sampled by **" + ENGINE_PATH in md


def _wheels(kind: str) -> Path:
    path = WHEELS / kind
    assert list(path.glob("*.whl")), (
        f"no wheels in {path}: scripts/setup_env.sh downloads them (python scripts/gpu_wheels.py "
        f"{'--this-python ' if kind == 'rehearsal' else ''}--dest {path}), or set GPU_CHECK_WHEELS"
    )
    return path


@pytest.mark.slow
def test_rehearsal_runs_every_part_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the script sets it: the checkout, then the wheels' site directory
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--tiny", "--fork-stages", "--wheels",
         str(_wheels("rehearsal")), "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["problems"] == []
    assert [s["name"] for s in report["stages"]] == ["install", "env", "tests", "ablation", "grpo_0_6b", "trl",
                                                     "qwen3_5", "backends", "moe", "grpo_1_7b"]
    # The carried packages were imported from the site directory, not from this interpreter's.
    packages = report["env"]["packages"]
    for name in ("torchtune", "torchao", "omegaconf", "datasets", "trl"):
        assert not packages[name]["from"].startswith(sys.prefix), (name, packages[name])
    assert packages["torchtune_grpo"]["from"] == str(REPO)
    # Every GPU test ran (on CPU) and passed, with its figures.
    tests = {t["name"]: t for t in report["tests"]}
    assert set(tests) == GPU_TESTS and all(t["outcome"] == "passed" for t in tests.values())
    assert tests["test_fsdp2_on_one_device_matches_the_plain_model"]["figures"]["fsdp2_vs_plain_max_weight_diff"] <= 1e-5
    # Every benchmark part, on the tiny stand-in of the Qwen3 shapes read from its Hugging Face directory.
    first, second = report["grpo"]
    # The check's decode part is the compiled step only (eager at one row was measured once: docs/gpu.md).
    assert [(d["rows"], d["compiled"]) for d in first["decode"]] == [(1, True), (8, True)]
    assert first["grpo"][0]["model"] == "tiny_qwen3" and first["grpo"][0]["rows"] == 16
    assert [r["model"] for r in first["recipe"] + second["recipe"]] == ["tiny_qwen3", "tiny_qwen3"]
    # The reference model per mode (on CPU: RSS, no device peak); the full copy is the baseline of the differences.
    modes = second["reference"][0]["modes"]
    assert list(modes) == ["compute", "int8", "nf4", "compute+offload", "nf4+offload"]
    assert modes["compute"]["logprob_abs_diff_max"] == 0 < modes["nf4"]["logprob_abs_diff_mean"]
    assert modes["compute+offload"]["logprob_abs_diff_max"] == 0  # offloading moves weights, not values
    assert sum(modes["nf4"]["bytes"].values()) < sum(modes["compute"]["bytes"].values())
    assert report["trl"]["rows"] == 16 and report["trl"]["median_step_s"] > 0
    assert report["ours_vs_trl"]["ratio"] > 0
    # The ablation: the baseline, the bf16 head and every switch together ("auto" checkpointing decides "off"
    # for a model of kilobytes; the layers compiled with aot_eager), each against the baseline: only the bf16
    # head's rounding differs (checkpointing and compiling change no number: tests/test_update_switches_exact.py).
    ablation = {r["variant"]: r for r in report["ablation"]["ablation"]}
    assert list(ablation) == ["baseline", "bf16_head", "all"]
    assert ablation["baseline"]["checkpointed_layers"] == "2/2" and ablation["all"]["checkpointed_layers"] == "0/2"
    assert ablation["all"]["compile_backend"] == "aot_eager" and ablation["all"]["warmup"]["compile_s"] > 0
    assert ablation["all"]["vs_baseline"] == ablation["bf16_head"]["vs_baseline"]
    for name in ("bf16_head", "all"):
        d = ablation[name]["vs_baseline"]
        # bf16 rounding of the hidden states and the weight (relative 2^-9 each) moves a logit by at most
        # 2 x 2^-9 x sum_i |h_i w_i|: normed hidden states ~1 and weights ~0.02 over 64 dimensions give
        # sum |h_i w_i| ~ 0.8, so 3e-3 per logit, and a logprob (a logit minus a log-sum-exp) twice that:
        # 6e-3 < 1e-2 (measured: max 8.8e-4). Not zero: the switch must really change the products.
        assert 0 < d["logprob_abs_mean"] <= d["logprob_abs_max"] < 1e-2, d
        assert d["grad_cosine"] > 0.99, d
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: OK") and "Step time, ours / TRL (tiny_qwen3)" in md
    assert "## The update's switches" in md
    assert "| nf4+offload |" in md
    # The Qwen3.5 stage: not a torchtune architecture, so the recipe trained transformers' module, and TRL ran
    # on the same directory and batch.
    qwen3_5 = report["qwen3_5"]
    assert qwen3_5["skipped"] is None and qwen3_5["backend"]["name"] == "transformers"
    assert qwen3_5["recipe"]["model"] == "tiny_qwen3_5" and qwen3_5["recipe"]["steps"] == 2
    assert qwen3_5["trl"]["model"] == "tiny_qwen3_5" and qwen3_5["trl"]["rows"] == 16
    assert qwen3_5["ours_vs_trl"]["ratio"] > 0
    # The backends stage: one directory, each backend's recipe run (2 steps) and what each really did.
    backends = report["backends"]
    assert list(backends["runs"]) == ["torchtune", "transformers"]
    assert all(r["steps"] == 2 for r in backends["runs"].values())
    torchtune_path, transformers_path = backends["paths"]["torchtune"], backends["paths"]["transformers"]
    assert torchtune_path["training_layout"] == transformers_path["training_layout"] == ["shared prompts"]
    assert torchtune_path["engine"] == ["native engine on torchtune's modules: SharedPrefixRollout + compaction"]
    assert transformers_path["engine"] == [ENGINE_PATH]
    assert set(backends["transformers_over_torchtune"]) == {"step", "generation", "train"}
    assert "## One model, both backends (tiny_qwen3)" in md and "**transformers / torchtune: step " in md
    assert "Step time, ours / TRL (tiny_qwen3_5, transformers backend)" in md
    # What each run really did (observed while it ran): Qwen3.5's update (Gated DeltaNet layers split by
    # sequence) and Gemma 3's (sliding and global layers) in shared-prompt rows on transformers' modules; both
    # sampled by the native engine on transformers' cache, prompts prefilled once per group, rows compacted out.
    assert_stage_paths(qwen3_5, md)
    # The MoE stage: the Qwen3-30B-A3B layout (its tiny stand-in) from the shipped MoE config, through
    # transformers' module; TRL on the same directory and batch, with no KL term on either side (as the config);
    # the paper estimate of our peak computed for the same run.
    moe = report["moe"]
    assert moe["skipped"] is None and moe["backend"]["name"] == "transformers"
    assert moe["config"] == "configs/qwen3_moe/30B-A3B_full_grpo.yaml"
    assert moe["recipe"]["model"] == "tiny_qwen3_moe" and moe["recipe"]["steps"] == 2
    assert moe["recipe"]["median"]["kl"] == 0 and moe["trl"]["kl_coef"] == 0.0
    assert moe["paths"]["tiny_qwen3_moe"]["training_layout"] == ["shared prompts"]  # a checked MoE family
    assert moe["paths"]["tiny_qwen3_moe"]["engine"] == [ENGINE_PATH]
    assert moe["trl"]["model"] == "tiny_qwen3_moe" and moe["trl"]["rows"] == 16 and moe["ours_vs_trl"]["ratio"] > 0
    assert moe["layout"] == {"layers": 2, "published_layers": 48, "experts": 8, "experts_per_token": 2}
    assert moe["paper_estimate"]["peak_gb"] > 0 and moe["paper_estimate"]["measured_peak_gb"] is None  # CPU
    assert "Step time, ours / TRL (tiny_qwen3_moe, transformers backend)" in md
    assert "Layout: Qwen3-30B-A3B's layer, 2 of 48 layers, 8 experts, 2 per token" in md


def test_device_wheel_bundle_fits_and_covers_every_requirement():
    # The set carried to the GPU machine (Python 3.12, manylinux x86-64): exactly scripts/gpu_wheels.py's
    # CARRY, each requirement carried, on the image or not needed, and with the source tree under 64 MiB.
    r = gpu_wheels.report(_wheels("device"))
    assert r["missing"] == [] and r["duplicates"] == [] and r["absent"] == []
    assert r["total_bytes"] <= gpu_wheels.LIMIT_BYTES, r["total_bytes"]
    tags = {w["file"].rsplit("-", 3)[1] for w in r["wheels"]}  # the Python tag of each wheel
    assert tags <= {"py3", "py2.py3", "cp312", "cp310", "py312"}, tags


def _fake_wheel(directory: Path, name: str, requires: list) -> Path:
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        meta = "Metadata-Version: 2.1\nName: {}\nVersion: 1.0\n".format(name)
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name}-1.0.dist-info/METADATA", meta)
    return path


def test_wheel_requirements_are_carried_on_the_image_or_missing(tmp_path):
    # a needs b (carried), numpy (on the image), blobfile (not needed) and zzz (nowhere);
    # a Windows-only and an extra-only requirement do not apply on the GPU machine.
    a = _fake_wheel(tmp_path, "a", ["b>=1", "numpy", "blobfile", "zzz", "pywin32; sys_platform == 'win32'",
                                    "rich; extra == 'fancy'"])
    b = _fake_wheel(tmp_path, "b", [])
    rows, missing = gpu_wheels.check_closure([a, b])
    where = {r["requires"]: r["from"] for r in rows}
    assert where == {"b": "carried", "numpy": "image", "blobfile": f"not needed: {gpu_wheels.NOT_NEEDED['blobfile']}",
                     "zzz": "MISSING"}
    assert missing == ["a -> zzz"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_gpu" name="test_a" time="1.5"><properties>
<property name="diff" value="0.25"/></properties></testcase>
<testcase classname="tests.test_gpu" name="test_b" time="2.0"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_gpu" name="test_c" time="0.1"><skipped message="why"/></testcase>
</testsuite></testsuites>"""


def test_report_reads_outcomes_figures_stages_and_the_trl_ratio(tmp_path):
    (tmp_path / "gpu_tests.xml").write_text(JUNIT)
    (tmp_path / "stages.jsonl").write_text(
        '{"name": "tests", "rc": 1, "seconds": 3}\n{"name": "trl", "rc": 124, "seconds": 90, "timed_out": true}\n')
    (tmp_path / "grpo_0_6b.json").write_text(json.dumps({
        "argv": [], "decode": [], "grpo": [], "errors": [{"part": "decode x", "error": "OOM"}],
        "recipe": [{"model": "qwen3_0_6b", "median": {"time/step": 3.0}}]}))
    (tmp_path / "trl.json").write_text(json.dumps({
        "model": "qwen3_0_6b", "trl": "1.16.0", "prompts": 32, "group": 8, "rows": 256, "micro_batch": 32,
        "dtype": "bf16", "median_step_s": 12.0, "tokens_per_s": 8000.0}))
    report = gpu_report.build_report(tmp_path)
    assert [(t["name"], t["outcome"]) for t in report["tests"]] == [
        ("test_a", "passed"), ("test_b", "failed"), ("test_c", "skipped")]
    assert report["tests"][0]["figures"] == {"diff": 0.25}
    # A skip is not a pass: the GPU check is not OK unless every test passed.
    assert report["problems"] == ["stage tests exited 1", "stage trl exited 124 (time limit)",
                                  "test test_b failed", "test test_c skipped", "gpu_grpo decode x: OOM"]
    assert not report["ok"]
    assert report["ours_vs_trl"] == {"model": "qwen3_0_6b", "ours_step_s": 3.0, "trl_step_s": 12.0, "ratio": 0.25}
    md = gpu_report.markdown(report)
    assert md.startswith("# GPU check: NOT OK") and "**Step time, ours / TRL (qwen3_0_6b): 0.25x**" in md


def test_report_without_any_test_result_is_not_ok(tmp_path):
    report = gpu_report.build_report(tmp_path)
    assert report["problems"] == ["no GPU test results (gpu_tests.xml)"] and not report["ok"]


def test_report_of_the_ablation_alone(tmp_path):
    # `--stages install,env,ablation`: no tests stage ran, so no test results is no problem; a variant that raised
    # is one. The whole-step MFU of a variant: 6 N tokens over the recipe's generation + reward seconds of the
    # same shape plus the variant's update step: 6 x 1e9 x 1e5 / (2 + 1 + 3) s / 1e15 FLOP/s = 0.1.
    (tmp_path / "stages.jsonl").write_text('{"name": "ablation", "rc": 0, "seconds": 200}\n')
    variant = {"model": "qwen3_0_6b", "variant": "baseline", "checkpointed_layers": "28/28", "tokens": 100_000,
               "flop_params": 1_000_000_000, "median": {"step_s": 3.0, "reference_s": 0.5, "update_s": 2.0},
               "warmup": {"compile_s": 0.0}, "tokens_per_s": 33_333.0, "mfu_train": 0.2}
    (tmp_path / "ablation.json").write_text(json.dumps({
        "device": "NVIDIA H200", "dtype": "bf16", "ceilings": {"matmul_bf16_tflops": 1000.0},
        "ablation": [variant], "errors": [{"part": "qwen3_1_7b no_ac", "error": "OutOfMemoryError: ..."}],
        "skipped": ["qwen3_1_7b tf32"]}))
    (tmp_path / "grpo_0_6b.json").write_text(json.dumps({
        "argv": [], "decode": [], "grpo": [], "errors": [],
        "recipe": [{"model": "qwen3_0_6b", "median": {"time/step": 9.0, "time/generation": 2.0, "time/reward": 1.0}}]}))
    report = gpu_report.build_report(tmp_path)
    assert report["problems"] == ["gpu_ablation qwen3_1_7b no_ac: OutOfMemoryError: ..."]
    assert report["ablation"]["ablation"][0]["whole_step"]["mfu_step"] == pytest.approx(0.1)
    md = gpu_report.markdown(report)
    assert "| qwen3_0_6b | baseline | 28/28 | 3 |" in md and "Skipped (time budget): qwen3_1_7b tf32" in md


def test_qwen3_5_stage_skips_with_the_reason_where_transformers_lacks_the_family(tmp_path, monkeypatch):
    # A transformers without the stage's model_type (faked: a shape of an unknown type): the stage writes the
    # reason, exits 0, and the report shows it without counting it as a problem; an error is a problem.
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_qwen3_5
    import hf_random

    monkeypatch.setitem(hf_random.SHAPES, "no_such_shape", dict(model_type="no_such_family"))
    monkeypatch.setattr(gpu_qwen3_5, "TINY_SHAPE", "no_such_shape")
    out = tmp_path / "qwen3_5.json"
    assert gpu_qwen3_5.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    import transformers

    reason = f"transformers {transformers.__version__} has no model_type 'no_such_family'"
    assert json.loads(out.read_text())["skipped"] == reason
    (tmp_path / "gpu_tests.xml").write_text(JUNIT.replace("<failure message=\"assert 1 == 2\">trace</failure>", "")
                                            .replace('<skipped message="why"/>', ""))
    report = gpu_report.build_report(tmp_path)
    assert report["ok"] and report["problems"] == []
    assert f"Skipped: {reason}." in gpu_report.markdown(report)
    out.write_text(json.dumps({"model": "qwen3_5_0_8b", "skipped": None, "errors": [{"part": "recipe qwen3_5_0_8b",
                                                                                     "error": "OOM"}]}))
    report = gpu_report.build_report(tmp_path)
    assert report["problems"] == ["gpu_qwen3_5 recipe qwen3_5_0_8b: OOM"] and not report["ok"]


def test_report_of_the_moe_stage_shows_the_estimate_beside_the_peak_and_counts_its_errors(tmp_path):
    # moe.json as benchmarks/gpu_moe.py writes it on a GPU (figures made up): the layout, both sides' peaks, the
    # paper estimate beside the measured peak (GiB from the allocator, converted: 40 GiB = 42.9 GB).
    (tmp_path / "stages.jsonl").write_text('{"name": "moe", "rc": 0, "seconds": 200}\n')
    moe = {"model": "qwen3_30b_a3b_2l", "skipped": None, "errors": [], "transformers": "5.17.0",
           "backend": {"name": "transformers", "reason": "model_type 'qwen3_moe': a mixture-of-experts model"},
           "recipe": {"median": {"time/step": 30.0, "time/generation": 20.0, "time/train": 10.0,
                                 "tokens_per_second": 12345.0, "memory/peak_allocated_gib": 40.0}},
           "trl": {"trl": "1.16.0", "median_step_s": 60.0, "tokens_per_s": 11111.0, "peak_allocated_gib": 50.0},
           "ours_vs_trl": {"ours_step_s": 30.0, "trl_step_s": 60.0, "ratio": 0.5},
           "layout": {"layers": 2, "published_layers": 48, "experts": 128, "experts_per_token": 8},
           "paper_estimate": {"parameters": {"total": 1868573184}, "peak_gb": 45.0, "measured_peak_gb": 40 * 2**30 / 1e9}}
    (tmp_path / "moe.json").write_text(json.dumps(moe))
    report = gpu_report.build_report(tmp_path)
    assert report["problems"] == [] and report["moe"]["model"] == "qwen3_30b_a3b_2l"
    md = gpu_report.markdown(report)
    assert "## A mixture of experts through the transformers backend (qwen3_30b_a3b_2l)" in md
    assert "| ours (recipe) | 30 | 20 | 10 | 12,345 | 40 |" in md and "| TRL 1.16.0 | 60 | | | 11,111 | 50 |" in md
    assert "**Step time, ours / TRL (qwen3_30b_a3b_2l, transformers backend): 0.50x**" in md
    assert "Layout: Qwen3-30B-A3B's layer, 2 of 48 layers, 128 experts, 8 per token; 1,868,573,184 parameters." in md
    assert "Our peak on paper (benchmarks/moe_memory.py): 45 GB; measured: 42.9 GB." in md
    moe["errors"] = [{"part": "recipe qwen3_30b_a3b_2l", "error": "OutOfMemoryError"}]
    (tmp_path / "moe.json").write_text(json.dumps(moe))
    report = gpu_report.build_report(tmp_path)
    assert report["problems"] == ["gpu_moe recipe qwen3_30b_a3b_2l: OutOfMemoryError"] and not report["ok"]


FORKED = """import atexit, os, subprocess, sys, threading, time
print(sys.argv[1:], os.getcwd(), os.environ.get("FORK_TEST"), sys.path[0], __name__, flush=True)
if sys.argv[1] == "exit":
    atexit.register(print, "atexit ran")
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended"))).start()
    print("not flushed")
    sys.exit(3)
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "path":
    import forkextra
    print(forkextra.VALUE, sys.stdout.write_through, flush=True)
if sys.argv[1] == "hidden":
    import importlib.util
    print(importlib.util.find_spec("csv"), flush=True)
    import csv
if sys.argv[1] == "sleep":
    print(subprocess.Popen(["sleep", "60"]).pid, flush=True)
    time.sleep(60)
"""


def test_forked_stages_run_as_their_own_interpreter_would(tmp_path):
    # scripts/fork_stages.py, as the rehearsal uses it: each command gets the caller's directory, environment,
    # arguments and streams, sys.path[0] of `python SCRIPT`, its exit status (an uncaught exception: 1) after its
    # threads and atexit handlers, hidden
    # packages are not installed for it, its own PYTHONPATH and -u (unbuffered streams) hold as in a fresh
    # interpreter (tests/_tune_server.py's tune runs), and a SIGTERM to `run` (timeout's) ends the command and
    # what it started.
    script, sock = tmp_path / "stage.py", str(tmp_path / "s.sock")
    script.write_text(FORKED)
    fork = [sys.executable, str(REPO / "scripts" / "fork_stages.py")]
    server = subprocess.Popen(fork + ["serve", sock, "--hide", "csv,wave", "json"])
    try:
        def run(*args, timeout=None):
            cmd = (["timeout", str(timeout)] if timeout else []) + fork + ["run", sock, str(script), *args]
            return subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "FORK_TEST": "yes"}, capture_output=True,
                                  text=True, timeout=60)

        p = run("exit")
        assert p.returncode == 3 and p.stdout.startswith(f"['exit'] {tmp_path} yes {tmp_path} __main__"), p
        # On its way out, as the interpreter: a non-daemon thread joined, then the atexit handlers, and what sat in
        # stdout's buffer is written (scripts/fork_stages.py skips only the interpreter's teardown of objects).
        assert p.stdout.splitlines()[1:] == ["not flushed", "thread ended", "atexit ran"], p
        p = run("raise")
        assert p.returncode == 1 and "ValueError: boom" in p.stderr, p
        p = run("hidden")
        assert p.returncode == 1 and "None\n" in p.stdout and "ModuleNotFoundError" in p.stderr, p
        (tmp_path / "extra").mkdir()
        (tmp_path / "extra" / "forkextra.py").write_text("VALUE = 'found'\n")
        p = subprocess.run(fork + ["run", sock, "-u", str(script), "path"], cwd=tmp_path, capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "extra")}, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.splitlines()[1] == "found True", p
        p = run("sleep", timeout=1)  # a forked command starts in milliseconds: it has started its sleep by then
        assert p.returncode == 124, p
        stat = Path(f"/proc/{int(p.stdout.splitlines()[1])}/stat")
        for _ in range(50):  # the killed sleep gone (or a zombie awaiting its reaper)
            if not stat.exists() or stat.read_text().split()[2] == "Z":
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the command's own child outlived the SIGTERM to `run`")
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_forked_command_that_crashes_prints_native_and_python_stacks(tmp_path):
    # scripts/fork_stages.py with torch imported and PYTHONFAULTHANDLER set (as tests/recipe_utils.py's tune_env sets
    # it for every launched rank): a segmentation fault prints every thread's C++ stack (torch's handler), then
    # faulthandler's Python stacks with the crashing thread marked, and the command dies of the signal.
    script, sock = tmp_path / "crash.py", str(tmp_path / "s.sock")
    script.write_text("import ctypes, threading\n"
                      "t = threading.Thread(target=lambda: ctypes.string_at(0))\nt.start()\nt.join()\n")
    fork = [sys.executable, str(REPO / "scripts" / "fork_stages.py")]
    server = subprocess.Popen(fork + ["serve", sock, "torch"])
    try:
        p = subprocess.run(fork + ["run", sock, str(script)], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONFAULTHANDLER": "1"}, timeout=120)
        assert p.returncode == -signal.SIGSEGV, p
        assert "SIGSEGV(11)" in p.stderr and "FatalSignalHandler" in p.stderr, p.stderr[-3000:]
        assert "Fatal Python error: Segmentation fault" in p.stderr and "Current thread" in p.stderr, p.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=10)
