"""Long-tailed completion lengths: padding, update time and decode speed, before/after in one run.

Two halves of a GRPO step pay for the longest completion:

- **update**: the same experience (scripted log-normal response lengths, median 64, capped at 1,024) trained
  by ``PolicyUpdate`` with ``micro_batch_size`` rows per forward (before) and with
  ``max_tokens_per_micro_batch`` (after), in both training layouts (one row per sequence, also packed into
  shared rows; shared prompts).
  Printed: the padding fraction of the forwards' token slots (load-independent) and seconds per update;
- **decode**: ``NativeGenerator`` with and without ``compact_decode`` on a near-uniform random model whose
  stop set makes lengths geometric with median ~64 (the same seed: the same tokens). Printed: decode
  row-steps computed (load-independent: rows x steps each decode step ran on) and tokens/s.

Timings on a shared machine are noisy: compare the ratios within one run, and read the printed load.

    python benchmarks/longtail.py                   # the default workload (~2 min on 2 cores)
    python benchmarks/longtail.py --groups 2 --max-len 128 --repeats 1   # a quick smoke run
"""

import argparse
import copy
import math
import os
import random
import time
from typing import Dict, List

import torch
from torchtune.models.qwen2 import qwen2

from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.loss import GRPOLoss
from torchtune_grpo.training.batch import TrainingBatch
from torchtune_grpo.training.update import Experience, PolicyUpdate


def build_model(vocab: int, max_seq_len: int) -> torch.nn.Module:
    """A random 4-layer Qwen2-shaped decoder, weights N(0, 0.02): near-uniform next-token distributions."""
    torch.manual_seed(0)
    model = qwen2(vocab_size=vocab, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=256,
                  intermediate_dim=512, max_seq_len=max_seq_len, tie_word_embeddings=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model


def lognormal_lengths(n: int, median: int, sigma: float, cap: int, rng: random.Random) -> List[int]:
    """``n`` lengths ``min(cap, round(median x exp(sigma Z)))``, at least 1."""
    return [max(1, min(cap, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))) for _ in range(n)]


def workload(groups: int, group_size: int, vocab: int, max_len: int, seed: int = 0):
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = [rng.randrange(1, vocab) for _ in range(rng.randint(32, 96))]
        for length in lognormal_lengths(group_size, 64, 1.0, max_len, rng):
            prompts.append(p)
            responses.append([rng.randrange(1, vocab) for _ in range(length)])
    return prompts, responses


def padding(batch: TrainingBatch, mbs: List[slice]) -> float:
    real = sum(batch.real_tokens(s) for s in mbs)
    padded = sum(batch.padded_tokens(s) for s in mbs)
    return 1.0 - real / padded


def update_case(model, prompts, responses, *, layout: Dict, rows: int, budget, repeats: int) -> Dict[str, float]:
    batch = TrainingBatch(prompts, responses, pad_id=0, **layout)
    n = len(batch)
    if budget is None:
        mbs, ordered = [slice(i, min(i + rows, n)) for i in range(0, n, rows)], batch
        budget_out = max(batch.padded_tokens(s) for s in mbs)
    else:
        plan = batch.plan(max_tokens=budget, max_rows=n)
        ordered, mbs = batch.select(plan.order, row_width=plan.row_width), plan.slices()
        budget_out = budget
    gen = torch.Generator().manual_seed(0)
    exp = Experience(batch=batch, mask=batch.response_mask, kept=torch.ones(n, dtype=torch.bool),
                     advantages=torch.randn(n, generator=gen), old_logprobs=None, ref_logprobs=None,
                     engine_logprobs=None)
    times = []
    for _ in range(repeats):
        m = copy.deepcopy(model).train()
        update = PolicyUpdate(m, torch.optim.SGD(m.parameters(), lr=0.0), GRPOLoss(),
                              micro_batch_size=rows if budget is None else n, max_tokens_per_micro_batch=budget)
        t0 = time.perf_counter()
        update(exp)
        times.append(time.perf_counter() - t0)
    return {"padding": padding(ordered, mbs), "seconds": min(times), "micro_batches": len(mbs),
            "peak": max(ordered.padded_tokens(s) for s in mbs), "budget": budget_out}


def decode_case(model, prompts, *, group_size: int, max_len: int, compact: bool, repeats: int, median: int = 64):
    vocab = model.tok_embeddings.num_embeddings
    # P(stop) ~ ln 2 / median per token (near-uniform next-token distributions): geometric lengths
    stops = list(range(1, 1 + round(vocab * math.log(2) / median)))
    row_steps = []
    hook = model.norm.register_forward_hook(lambda mod, inp, out: row_steps.append(inp[0].shape[0]))
    times, lengths = [], None
    try:
        for _ in range(repeats):
            row_steps.clear()
            engine = NativeGenerator(temperature=1.0, compact_decode=compact)
            t0 = time.perf_counter()
            out = engine.generate(model, prompts, group_size=group_size, max_new_tokens=max_len, pad_id=0,
                                  stop_tokens=stops, generator=torch.Generator().manual_seed(0))
            times.append(time.perf_counter() - t0)
            lengths = [len(r) for r in out.response_ids]
    finally:
        hook.remove()
    tokens = sum(lengths)
    return {"seconds": min(times), "tokens": tokens, "tokens_per_s": tokens / min(times),
            "row_steps": sum(row_steps[1:]), "lengths": sorted(lengths), "ids": out.response_ids}


def update_table(model, prompts, responses, args) -> None:
    print("\nupdate (one optimizer step over all rows)")
    print("| layout | micro-batches | count | largest (slots) | padding | s/update | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, layout, others in (
        ("one row per sequence", dict(share_prompt=False), [("packed rows", dict(share_prompt=False, pack=True))]),
        ("shared prompts", dict(share_prompt=True), []),
    ):
        before = update_case(model, prompts, responses, layout=layout, rows=args.rows, budget=None, repeats=args.repeats)
        budget = args.budget or before["budget"]
        cases = [(name, f"{args.rows} rows", before)]
        for label, lay in [(name, layout)] + others:
            r = update_case(model, prompts, responses, layout=lay, rows=args.rows, budget=budget, repeats=args.repeats)
            cases.append((label, f"<= {budget} tokens", r))
        for label, split, r in cases:
            print(f"| {label} | {split} | {r['micro_batches']} | {r['peak']} | {r['padding']:.1%} | "
                  f"{r['seconds']:.2f} | {r['seconds'] / before['seconds']:.2f} |")


def decode_table(model, prompts, args) -> None:
    print("\ndecode (native engine, fp32, shared-prefix cache)")
    gen_prompts = [prompts[i * args.group_size] for i in range(args.groups)]
    kw = dict(group_size=args.group_size, max_len=args.max_len, repeats=args.repeats, median=args.decode_median)
    plain = decode_case(model.eval(), gen_prompts, compact=False, **kw)
    compact = decode_case(model, gen_prompts, compact=True, **kw)
    lens = plain["lengths"]
    print(f"lengths: median {lens[len(lens) // 2]}, max {lens[-1]}; same tokens: {plain['ids'] == compact['ids']}")
    print("| decode | row-steps | s | tokens/s | ratio (time) |")
    print("|---|---|---|---|---|")
    for label, r in (("every row to the end", plain), ("compact_decode", compact)):
        print(f"| {label} | {r['row_steps']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['seconds'] / plain['seconds']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=8, help="micro_batch_size of the 'before' update")
    parser.add_argument("--budget", type=int, default=None,
                        help="max_tokens_per_micro_batch of the 'after' update; default: the largest 'before' "
                             "micro-batch's token slots (the same peak activation memory)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-median", type=int, default=64, help="median completion length when decoding")
    parser.add_argument("--decode-only", action="store_true", help="skip the update half")
    parser.add_argument("--threads", type=int, default=1, help="1: 2 threads on 2 loaded cores were 5x slower")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}; {args.threads} threads; torch {torch.__version__}")
    vocab = 2048
    model = build_model(vocab, max_seq_len=8192)
    prompts, responses = workload(args.groups, args.group_size, vocab, args.max_len)
    lens = sorted(len(r) for r in responses)
    print(f"{len(lens)} responses: median {lens[len(lens) // 2]}, max {lens[-1]}, mean {sum(lens) / len(lens):.0f}")
    if not args.decode_only:
        update_table(model, prompts, responses, args)
    decode_table(model, prompts, args)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
