"""Peak memory of the logprob + loss path (``chunked_logprobs`` + ``GRPOLoss``, forward and backward).

Qwen2.5-0.5B's output layer: hidden 896, vocabulary 151,936. The hidden states ``[1, T, 896]`` and the
projection weight (random, fp32) are allocated first; then one forward + backward of exactly what the recipe
runs per micro-batch (per-token logprobs and the logged entropy, chunk by chunk, the clipped GRPO loss,
``backward``). Each configuration runs in a fresh process, and the extra memory is its peak RSS (the
kernel's high-water mark ``VmHWM``, reset just before the forward through ``/proc/self/clear_refs``) minus
its RSS just before the forward. (Not ``ru_maxrss``: it is kept across ``fork`` + ``exec``, so a child of a
large process, such as a test runner that imported torch, would report its parent's size.)

The extra memory is split into what any training step holds anyway (the projection's weight gradient,
``V x D x 4`` bytes, and the hidden states' gradient, ``T x D x 4`` bytes) and the rest, the working memory
of the chunked computation, which should depend on the chunk size and not on T.

    python benchmarks/logprob_memory.py                       # T = 512, 1024, 2048; chunk 512 and 256
    python benchmarks/logprob_memory.py --tokens 65536        # the full 64k case (slow on a CPU)
    python benchmarks/logprob_memory.py --device cuda         # on a GPU: the caching allocator's peak

On CUDA the extra memory is ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` just before the
forward (the tensors' own high-water mark, not the allocator's reserved pool).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

HIDDEN = 896
VOCAB = 151_936


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process to its current RSS (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    """This process's peak RSS in bytes since the last reset (``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure(
    tokens: int, chunk_size: int, hidden_dim: int, vocab: int, threads: int, fused: bool = True,
    device: str = "cpu",
) -> Dict[str, Any]:
    """One forward + backward in this process; returns the memory figures in bytes.

    On CPU the process's peak RSS is the measure, so call it in a fresh process (``_child``).
    """
    import psutil
    import torch

    from torchtune_grpo.models.logprobs import chunked_logprobs
    from torchtune_grpo.loss import GRPOLoss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dev = torch.device(device)
    proj = torch.nn.Linear(hidden_dim, vocab, bias=False, device=dev)
    with torch.no_grad():
        proj.weight.normal_(0.0, 0.02)
    # [1, T, D] stands in for the last hidden states.
    hidden = torch.randn(1, tokens, hidden_dim, device=dev).requires_grad_(True)
    targets = torch.randint(0, vocab, (1, tokens), device=dev)
    advantages = torch.ones(1, device=dev)
    mask = torch.ones(1, tokens, dtype=torch.bool, device=dev)
    loss_fn = GRPOLoss(epsilon=0.2, loss_agg_mode="token-mean")
    # Warm up the kernels and the allocator on a tiny problem, then measure from here.
    small = chunked_logprobs(
        hidden[:, :8], targets[:, :8], proj, chunk_size=chunk_size, with_entropy=True, fused=fused
    )
    small.logprobs.sum().backward()
    proj.weight.grad = None
    hidden.grad = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    else:
        _reset_peak_rss()
        before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    out = chunked_logprobs(
        hidden, targets, proj, chunk_size=chunk_size, with_entropy=True, entropy_grad=False, fused=fused
    )
    loss = loss_fn(
        out.logprobs,
        out.logprobs.detach(),
        advantages,
        mask,
        entropy=out.entropy,
        num_tokens=tokens,
        num_seqs=1,
    ).loss
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = _peak_rss()
    seconds = time.perf_counter() - t0
    extra = peak - before
    weight_grad = vocab * hidden_dim * 4
    hidden_grad = tokens * hidden_dim * 4
    return {
        "device": device,
        "tokens": tokens,
        "chunk_size": chunk_size,
        "path": "fused" if fused else "checkpointed",
        "vocab": vocab,
        "hidden": hidden_dim,
        "seconds": seconds,
        "hidden_states_bytes": tokens * hidden_dim * 4,
        "extra_peak_bytes": extra,
        "weight_grad_bytes": weight_grad,
        "hidden_grad_bytes": hidden_grad,
        "working_bytes": extra - weight_grad - hidden_grad,
        "full_logits_bytes": tokens * vocab * 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[512, 256])
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--generic", action="store_true", help="measure the per-chunk checkpointing path")
    parser.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (allocator peak)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: List[Dict[str, Any]] = []
    for chunk in args.chunk_sizes:
        for tokens in args.tokens:
            cmd = [
                sys.executable, __file__, "_child", str(tokens), str(chunk), str(args.hidden),
                str(args.vocab), str(args.threads), "0" if args.generic else "1", args.device,
            ]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            results.append(res)
            print(
                f"{res['path']}: T={tokens:6d} chunk={chunk:4d}: extra peak {res['extra_peak_bytes'] / 2**20:7.0f} MiB = "
                f"weight grad {res['weight_grad_bytes'] / 2**20:.0f} + hidden grad "
                f"{res['hidden_grad_bytes'] / 2**20:.0f} + working {res['working_bytes'] / 2**20:.0f} MiB "
                f"(full fp32 logits would be {res['full_logits_bytes'] / 2**30:.1f} GiB; {res['seconds']:.1f} s)",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        # _child T[,T2,...] CHUNK HIDDEN VOCAB THREADS FUSED [DEVICE]: one JSON line per T, in this process
        # (each measurement resets the peak first).
        c, d, v, th, fu = (int(x) for x in sys.argv[3:8])
        for t in (int(x) for x in sys.argv[2].split(",")):
            print(json.dumps(measure(t, c, d, v, th, bool(fu), sys.argv[8] if len(sys.argv) > 8 else "cpu")))
    else:
        main()
