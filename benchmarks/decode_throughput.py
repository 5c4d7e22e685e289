"""Decode throughput of the native engine against the memory-bandwidth bound, on a GPU.

A decode step reads every weight once plus the KV cache of every row, so at batch ``b`` the step time is at
least ``(weight bytes + KV bytes read) / memory bandwidth``; the bound on tokens/s is ``b`` over that. This
script times ``NativeGenerator.generate`` on a randomly initialised model of a real shape (no download),
subtracts a 1-token run to leave the decode steps only, and prints tokens/s and the fraction of the bound.

    # on a GPU (bf16, decode step compiled with CUDA graphs)
    python benchmarks/decode_throughput.py --model qwen2_5_0_5b --batch 1 256 --bandwidth-gbs 3350
    python benchmarks/decode_throughput.py --model qwen2_5_1_5b --batch 1 256 --compile off
    # smoke test anywhere
    python benchmarks/decode_throughput.py --model tiny --device cpu --dtype fp32 --batch 1 8 --new-tokens 16

H100 SXM: 3,350 GB/s (HBM3); H200: 4,800 GB/s. Numbers go in docs/benchmarks/gpu_runs.md with the device name.
"""

import argparse
import time
from typing import Any, Dict

import torch

from torchtune_grpo.generation import NativeGenerator

MODELS = {
    "qwen2_5_0_5b": ("torchtune.models.qwen2_5", "qwen2_5_0_5b", {}),
    "qwen2_5_1_5b": ("torchtune.models.qwen2_5", "qwen2_5_1_5b_instruct", {}),
    "tiny": (
        "torchtune.models.qwen2",
        "qwen2",
        dict(vocab_size=512, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=128,
             intermediate_dim=256, max_seq_len=4096, tie_word_embeddings=True),
    ),
}


def build(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import importlib

    module, fn, kwargs = MODELS[name]
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            model = getattr(importlib.import_module(module), fn)(**kwargs)
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_generate(engine, model, prompts, new_tokens, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        engine.generate(
            model, prompts, group_size=1, max_new_tokens=new_tokens, pad_id=0, stop_tokens=[-1],
            generator=torch.Generator(device=device).manual_seed(0),
        )
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(args, model, batch: int, device: torch.device) -> Dict[str, Any]:
    compile_decode = {"auto": None, "on": True, "off": False}[args.compile]
    engine = NativeGenerator(temperature=1.0, compile_decode=compile_decode, stop_check_interval=1 << 30)
    vocab = model.tok_embeddings.num_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g).tolist()
    # Warm-up (and compilation) at the same shapes.
    timed_generate(engine, model, prompts, args.new_tokens, device, 1)
    full = timed_generate(engine, model, prompts, args.new_tokens, device, args.repeats)
    prefill_only = timed_generate(engine, model, prompts, 1, device, args.repeats)
    decode_s = max(full - prefill_only, 1e-9)
    steps = args.new_tokens - 1
    tokens_per_s = batch * steps / decode_s
    # Bound: each step reads all weights + the KV cache up to the current length (mean over the steps).
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    attn = [m for m in model.modules() if hasattr(m, "num_kv_heads") and hasattr(m, "head_dim")]
    kv_per_token = sum(2 * a.num_kv_heads * a.head_dim for a in attn) * model.tok_embeddings.weight.element_size()
    mean_ctx = args.prompt_len + args.new_tokens / 2
    step_bytes = param_bytes + batch * mean_ctx * kv_per_token
    bound = batch / (step_bytes / (args.bandwidth_gbs * 1e9)) if args.bandwidth_gbs else None
    return {
        "batch": batch,
        "decode_tokens_per_s": tokens_per_s,
        "decode_step_ms": decode_s / steps * 1e3,
        "bound_tokens_per_s": bound,
        "fraction_of_bound": tokens_per_s / bound if bound else None,
        "compiled": engine.compiles_decode(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2_5_0_5b", choices=list(MODELS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth, GB/s")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build(args.model, device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} on {name}, {args.dtype}, prompt {args.prompt_len}, {args.new_tokens} new tokens")
    for batch in args.batch:
        r = measure(args, model, batch, device)
        bound = f"{r['bound_tokens_per_s']:.0f}" if r["bound_tokens_per_s"] else "n/a"
        frac = f"{r['fraction_of_bound']:.0%}" if r["fraction_of_bound"] else "n/a"
        print(
            f"batch {batch:4d}: {r['decode_tokens_per_s']:10.0f} tokens/s ({r['decode_step_ms']:.2f} ms/step), "
            f"bandwidth bound {bound} tokens/s ({frac}), compiled={r['compiled']}"
        )


if __name__ == "__main__":
    main()
