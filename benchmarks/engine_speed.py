"""Rollout time of the native engine.

Rollout time of ``generate`` (B prompts x G samples, the workload's budget, no stop token so every run
decodes the same number of tokens) on the plain model, as the recipe runs it on one process, or
(``--fsdp 1``) on a model wrapped with FSDP2 on one gloo process and gathered once for the rollout, as the
recipe runs it on several. Medians over ``--repeats`` rollouts after one warm-up.

To compare with another revision, run the same script from a checkout of it::

    git worktree add /tmp/before REV
    PYTHONPATH=/tmp/before python /tmp/before/benchmarks/engine_speed.py --workloads tiny llama100m
    python benchmarks/engine_speed.py --workloads tiny llama100m
"""

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import grpo_vs_trl as bench  # benchmarks/ is on sys.path: this script's directory (harness.py)

from torchtune_grpo.generation import NativeGenerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", nargs="+", default=["tiny", "llama100m"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fsdp", type=int, default=0, help="1: FSDP2-wrap the model (gathered once)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    engines = {"new": NativeGenerator()}
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for name in args.workloads:
        spec = bench.WORKLOADS[name]
        torch.manual_seed(0)
        model = bench.build_tune_model(spec)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.fill_(1.0) if "norm" in pname else p.normal_(0.0, 0.02)
        model.eval()
        if args.fsdp:
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            model(torch.tensor([[1, 2, 3]]))
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.unshard()
                    m.set_reshard_after_forward(False, recurse=False)
        from torchtune_grpo.data import arithmetic_dataset

        tok = bench.build_tokenizer(Path(bench.tokenizer_files()["vocab.json"]).parent)
        ds = arithmetic_dataset(tok, **bench.dataset_kwargs())
        prompts = [ds[i]["tokens"] for i in range(spec["batch_size"])]
        kw = dict(group_size=spec["group_size"], max_new_tokens=spec["max_new_tokens"], pad_id=480, stop_tokens=[-1])
        times = {k: [] for k in engines}
        for r in range(args.repeats + 1):
            for k, eng in engines.items():
                t0 = time.perf_counter()
                eng.generate(model, prompts, generator=torch.Generator().manual_seed(r), **kw)
                if r:  # the first round warms up
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        n_tok = spec["batch_size"] * spec["group_size"] * spec["max_new_tokens"]
        print(json.dumps({"workload": name, "threads": args.threads, "fsdp": bool(args.fsdp),
                          **{f"{k}_s": round(v, 3) for k, v in med.items()},
                          **{f"{k}_tokens_per_s": round(n_tok / v, 1) for k, v in med.items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
