"""The native engine's eager decode on transformers' modules, with and without two of its savings, alternated.

- ``masks``: decode steps handed their attention masks built (``HFRollout._decode_step_mask``) against transformers
  building them from the 2-D padding mask at every token; a random tiny Qwen2 of the long-tail workload's shape
  (4 layers, hidden 128, 4 heads, 2 key/value heads, 512 ids), 4 left-padded prompts x 8 rows.
- ``window``: sliding-window layers on :class:`~torchtune_grpo.generation._hf_cache.GrowingWindowLayer` against
  transformers' ``DynamicSlidingWindowLayer`` (a ``torch.cat`` of the whole window per token); a random tiny Gemma 3
  shape (6 layers, five windowed at 512 tokens, hidden 256, 1 key/value head of 64), 4 prompts x 8 rows.

Each variant decodes greedily for ``--steps`` tokens in the same process, alternating ``--rounds`` times; the
report gives each round's seconds and whether the logits (every 50th step) are equal bit for bit.

    python benchmarks/hf_decode_steps.py --parts masks window --threads 1 --json hf_decode_steps.json
"""

import argparse
import time
from typing import Any, Callable, Dict, List

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from harness import loadavg, write_report
import torchtune_grpo.generation._hf_cache as hf_cache
from torchtune_grpo.generation._hf_rollout import HFRollout
from torchtune_grpo.models import grouped_kv_attention

PROMPT_LENGTHS = (14, 17, 20, 15)
GROUP = 8


def _model(part: str) -> torch.nn.Module:
    if part == "masks":
        config = AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096)
    else:
        config = AutoConfig.for_model("gemma3_text", num_hidden_layers=6, sliding_window=512, vocab_size=512,
                                      hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                                      layer_types=["sliding_attention"] * 5 + ["full_attention"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _transformers_window_layers(layer: Any, full_history: bool) -> Any:
    """``growing_cache``'s choice with transformers' own sliding-window layers kept (the ``window`` baseline)."""
    if type(layer) is hf_cache.DynamicSlidingWindowLayer:
        return layer
    return _GROWING(layer, full_history)


_GROWING: Callable[..., Any] = hf_cache._growing


def decode(hf: torch.nn.Module, prompts: List[List[int]], steps: int, saving: bool, part: str):
    """Seconds for ``steps`` greedy decode steps, every 50th step's logits ``[steps / 50, N, V]`` and the first cache
    layer's class."""
    hf_cache._growing = _GROWING if saving or part != "window" else _transformers_window_layers
    try:
        run = HFRollout(hf, prompts, GROUP, 0)
        if part == "masks":
            run._ready_masks = saving
        with torch.inference_mode(), grouped_kv_attention(hf):
            logits = run.prefill()
            token, kept = logits.argmax(-1), []
            start = time.perf_counter()
            for t in range(steps):
                logits = run.decode(token, t)
                token = logits.argmax(-1)
                if t % 50 == 0:
                    kept.append(logits)
            return time.perf_counter() - start, torch.stack(kept), type(run.cache.layers[0]).__name__
    finally:
        hf_cache._growing = _GROWING


def measure(part: str, steps: int, rounds: int) -> Dict[str, Any]:
    hf = _model(part)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    seconds: Dict[str, List[float]] = {"without": [], "with": []}
    equal, layers = [], {}
    for _ in range(rounds):
        base, base_logits, layers["without"] = decode(hf, prompts, steps, False, part)
        ours, our_logits, layers["with"] = decode(hf, prompts, steps, True, part)
        seconds["without"].append(round(base, 3))
        seconds["with"].append(round(ours, 3))
        equal.append(bool(torch.equal(base_logits, our_logits)))
    return {"steps": steps, "rows": GROUP * len(PROMPT_LENGTHS), "seconds": seconds, "logits_equal": equal,
            "first_cache_layer": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["masks", "window"], choices=["masks", "window"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"machine": {"threads": args.threads, "loadavg_before": loadavg()}, "parts": {}}
    lines = []
    for part in args.parts:
        report["parts"][part] = result = measure(part, args.steps, args.rounds)
        lines.append(f"[{part}] {result['rows']} rows x {args.steps} steps: without {result['seconds']['without']} s, "
                     f"with {result['seconds']['with']} s; logits equal bit for bit: {result['logits_equal']}")
    report["machine"]["loadavg_after"] = loadavg()
    write_report(report, args.json, markdown="\n".join(lines))


if __name__ == "__main__":
    main()
