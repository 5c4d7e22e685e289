"""Is the update slower in a process that also runs a vLLM engine? Measured side by side.

One process, one model, the same update (forward with ``sequence_logprobs``, backward, AdamW step on a
fixed batch), each timed right after a rollout as in the recipe: first with the native engine (before vLLM
starts), then, with a started and synced ``VLLMGenerator`` in the same process, after native and vLLM
rollouts in alternation (both under the same load). Reported with each: torch's intra-op thread count,
``OMP_NUM_THREADS``, the CPU affinity, the process's resident memory and the load average, because the
suspects are threads and memory and the machine is shared. Ratios within one run are what to read.

    python benchmarks/vllm_update_slowdown.py MODEL_DIR [--batch 8] [--seq 176] [--repeats 3]

``MODEL_DIR`` is a Hugging Face directory (e.g. SmolLM2-135M from ``benchmarks/smollm2.py``, or
``hf_random.write_model_dir("llama100m", ...)``).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist


def _state() -> dict:
    return {
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "affinity": sorted(os.sched_getaffinity(0)),
        "rss_gib": round(psutil.Process().memory_info().rss / 2**30, 2),
        "loadavg_1min": os.getloadavg()[0],
    }


def _time_updates(model, optimizer, batch, repeats: int, rollout) -> list:
    """Update times, each right after a rollout (as in the recipe: spinning OpenMP workers or caches left by
    the engine would show in the update that follows it)."""
    from torchtune_grpo.models.logprobs import sequence_logprobs

    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        rollout()
        model.train()
        t0 = time.perf_counter()
        loss = -sequence_logprobs(model, batch).logprobs.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--batch", type=int, default=8, help="sequences per update")
    parser.add_argument("--seq", type=int, default=176, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")  # as the recipe does, even on one process

    from torchtune_grpo.generation import NativeGenerator, VLLMGenerator, full_weights
    from torchtune_grpo.models import hf_model, HFCheckpointer

    model = hf_model(args.model_dir, max_seq_len=args.seq + 64)
    state = HFCheckpointer(args.model_dir, output_dir=f"/tmp/vllm_update_slowdown_{os.getpid()}").load_checkpoint()
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.tok_embeddings.num_embeddings
    batch = torch.randint(3, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    result = {"model_dir": args.model_dir, "batch": args.batch, "seq": args.seq}
    prompts = [batch[i, :32].tolist() for i in range(2)]
    kw = dict(group_size=4, max_new_tokens=32, pad_id=0, stop_tokens=[0], generator=torch.Generator().manual_seed(0))
    native = NativeGenerator()

    def native_rollout():
        model.eval()
        native.generate(model, prompts, **kw)

    result["native_engine"] = {
        **_state(), "update_s": _time_updates(model, optimizer, batch, args.repeats, native_rollout)
    }

    engine = VLLMGenerator(model=args.model_dir, dtype="fp32", max_model_len=args.seq + 64,
                           kv_cache_memory_gib=args.kv_gib)
    engine.load_weights(full_weights(model, torch.device("cpu")))
    # With the engine started: native and vLLM rollouts alternate, each followed by a timed update, so both
    # see the same machine load (the machine is shared) and only "what ran just before" differs.
    native_s, vllm_s = [], []
    for _ in range(args.repeats):
        native_s += _time_updates(model, optimizer, batch, 1, native_rollout)[-1:]
        vllm_s += _time_updates(model, optimizer, batch, 1, lambda: engine.generate(None, prompts, **kw))[-1:]
    result["engine_started"] = {**_state(), "update_s_after_native_rollout": native_s,
                                "update_s_after_vllm_rollout": vllm_s}
    before = statistics.median(result["native_engine"]["update_s"])
    result["update_ratio_after_vllm_over_after_native"] = round(statistics.median(vllm_s) / statistics.median(native_s), 3)
    result["update_ratio_engine_started_over_before"] = round(statistics.median(native_s + vllm_s) / before, 3)
    engine.close()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
