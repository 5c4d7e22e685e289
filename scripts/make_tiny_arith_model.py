#!/usr/bin/env python
"""Writes ``torchtune_grpo/assets/tiny_qwen2_arith/``: the tiny Qwen2 model warm-started on arithmetic.

Usage (from the repository root, after ``scripts/make_tiny_assets.py`` has written ``tiny_qwen2``)::

    python scripts/make_tiny_arith_model.py                # writes torchtune_grpo/assets/tiny_qwen2_arith/
    python scripts/make_tiny_arith_model.py --out /tmp/x   # writes elsewhere

Why: the random-init ``tiny_qwen2`` never writes the ``</think> <answer> N </answer>`` format or a right
answer, so in the tiny GRPO demo every reward is 0, every advantage 0 and GRPO does nothing. This script
starts from ``tiny_qwen2`` and runs a short supervised fine-tune (teacher forcing, plain PyTorch loop on
the torchtune model) on the tiny demo's task: the ``arithmetic_dataset`` TRAIN split with the demo config's
problem space (operands 0..20, ``+`` and ``-``, no negative answers), R1 prompts ending with ``<think>``,
and completions such as::

    " 17 + 5 = 22 </think> <answer> 22 </answer><|endoftext|>"

The loss covers only the completion tokens, eos included (prompt positions and padding are ignored).
Training is deliberately short: the result writes the format almost always but is right only part of the
time when sampled at temperature 1, so GRPO groups get mixed rewards and have room to improve. The
script ends by printing format rate and accuracy (scored with the recipe's own ``FormatReward`` and
``MathAnswerReward``) on the validation split and on the demo config's 256 prompts; ``--no-eval`` skips
that.

Deterministic: fixed seeds and one CPU thread, so a re-run writes byte-identical files (checked on the
machine it was made on; other CPUs may round differently). The tokenizer and config files are copied
unchanged from ``tiny_qwen2``. Takes about a minute on one core: every prompt starts with the same
64-token instruction, which the training forward runs once per batch (:func:`shared_prefix_forward`).
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_tiny_assets as tiny  # noqa: E402  (model sizes, shared with the base asset)
from torchtune.models.qwen2 import qwen2  # noqa: E402
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune, qwen2_tune_to_hf  # noqa: E402
from torchtune.models.qwen2_5 import qwen2_5_tokenizer  # noqa: E402

from torchtune_grpo.data import arithmetic_dataset  # noqa: E402
from torchtune_grpo.data._arithmetic import arithmetic_problems  # noqa: E402
from torchtune_grpo.generation import NativeGenerator, decode_responses  # noqa: E402
from torchtune_grpo.models.logprobs import replace_unembed  # noqa: E402
from torchtune_grpo.rewards import FormatReward, MathAnswerReward, RewardBatch  # noqa: E402

BASE_DIR = REPO_ROOT / "torchtune_grpo" / "assets" / "tiny_qwen2"
DEFAULT_OUT = REPO_ROOT / "torchtune_grpo" / "assets" / "tiny_qwen2_arith"
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
)

# The tiny demo's problem space (configs/tiny/full_grpo_cpu.yaml: max_value 20, default operations).
MIN_VALUE, MAX_VALUE = 0, 20
OPERATIONS = ("+", "-")
# One thread: results do not depend on the machine's core count, and a busy machine does not stall
# OpenMP barriers (with 2 threads on 2 shared cores, steps were 4x slower than with 1).
NUM_THREADS = 1

# SFT hyperparameters, tuned so that sampling at temperature 1 gives the format almost always and the
# right answer only part of the time (see the README of the asset for the measured numbers).
STEPS = 500
BATCH_SIZE = 64
LR = 3e-3
WARMUP_STEPS = 10  # linear warmup, then constant
WEIGHT_DECAY = 0.0
CLIP_GRAD_NORM = 1.0
IGNORE_INDEX = -100


def completion_text(a: int, op: str, b: int, answer: str) -> str:
    """The target completion (the prompt already ends with ``<think>``); the eos token is added as an id."""
    return f" {a} {op} {b} = {answer} </think> <answer> {answer} </answer>"


def load_tokenizer(asset_dir: Path):
    return qwen2_5_tokenizer(
        path=str(asset_dir / "vocab.json"),
        merges_file=str(asset_dir / "merges.txt"),
        special_tokens_path=str(asset_dir / "tokenizer.json"),
        max_seq_len=None,
    )


def build_model() -> torch.nn.Module:
    return qwen2(
        vocab_size=tiny.VOCAB_SIZE,
        num_layers=tiny.NUM_LAYERS,
        num_heads=tiny.NUM_HEADS,
        num_kv_heads=tiny.NUM_KV_HEADS,
        embed_dim=tiny.EMBED_DIM,
        intermediate_dim=tiny.INTERMEDIATE_DIM,
        max_seq_len=tiny.MAX_SEQ_LEN,
        norm_eps=tiny.NORM_EPS,
        rope_base=tiny.ROPE_BASE,
        tie_word_embeddings=True,
    )


def load_base_model(base_dir: Path) -> torch.nn.Module:
    model = build_model()
    hf_state = load_file(str(base_dir / "model.safetensors"))
    state = qwen2_hf_to_tune(
        hf_state,
        num_heads=tiny.NUM_HEADS,
        num_kv_heads=tiny.NUM_KV_HEADS,
        dim=tiny.EMBED_DIM,
        tie_word_embeddings=True,
    )
    model.load_state_dict(state)
    return model


def split_size(split: str) -> int:
    """Number of distinct problems in a split of the demo's problem space.

    ``arithmetic_problems`` raises ValueError when asked for more problems than the split holds, so the
    largest request it serves is found by bisection (public API only; about 10 cheap calls).
    """
    lo, hi = 1, (MAX_VALUE - MIN_VALUE + 1) ** 2 * len(OPERATIONS)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            arithmetic_problems(mid, MIN_VALUE, MAX_VALUE, OPERATIONS, split=split)
            lo = mid
        except ValueError:
            hi = mid - 1
    return lo


def build_split(tokenizer, split: str, seed: int):
    """The whole split as an ``arithmetic_dataset`` (exactly the prompts the GRPO recipe builds)."""
    return arithmetic_dataset(
        tokenizer,
        num_samples=split_size(split),
        min_value=MIN_VALUE,
        max_value=MAX_VALUE,
        operations=OPERATIONS,
        seed=seed,
        split=split,
        max_prompt_length=None,
    )


def sft_examples(tokenizer, dataset) -> Tuple[List[int], List[Tuple[List[int], List[int]]]]:
    """Splits every ``prompt + completion + eos`` sequence into the prefix all of them share and the rest.

    Every prompt starts with the same R1 instruction (about 65 of its ~76 tokens), so the training forward
    runs that prefix once per batch instead of once per sequence (see :func:`shared_prefix_forward`).

    Returns:
        Tuple: ``(prefix ids, [(suffix ids, suffix labels), ...])``; labels are the suffix ids on completion
        tokens and ``IGNORE_INDEX`` on the prompt's own tokens.
    """
    sequences = []
    for i in range(len(dataset)):
        row = dataset[i]
        prompt = list(row["tokens"])
        target = tokenizer.encode(
            completion_text(row["a"], row["op"], row["b"], row["answer"]), add_bos=False, add_eos=False
        )
        # The prompt is tokenized alone (as the recipe does) and the completion appended as ids, exactly
        # what the policy generates: ids after the prompt's last token.
        sequences.append((prompt, list(target) + [tokenizer.eos_id]))
    prefix_len = min(len(p) for p, _ in sequences)
    first = sequences[0][0]
    for prompt, _ in sequences:
        prefix_len = next((j for j in range(prefix_len) if prompt[j] != first[j]), prefix_len)
    # Keep at least one prompt token in every suffix; labels start after the prompt, never in the prefix.
    prefix_len = min(prefix_len, min(len(p) for p, _ in sequences) - 1)
    examples = [
        (prompt[prefix_len:] + target, [IGNORE_INDEX] * (len(prompt) - prefix_len) + target)
        for prompt, target in sequences
    ]
    return first[:prefix_len], examples


def collate(examples: List[Tuple[List[int], List[int]]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-pads ``(ids, labels)`` pairs into ``tokens [B, S]`` and ``labels [B, S]``."""
    seq_len = max(len(ids) for ids, _ in examples)
    tokens = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        tokens[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
    return tokens, labels


def _self_attention(attn, x: torch.Tensor, positions: torch.Tensor, prefix_kv=None):
    """torchtune ``MultiHeadAttention`` (Qwen2: biases, RoPE, no q/k norm) on ``x [B, S, D]``, causal.

    With ``prefix_kv = (k, v)`` (each ``[1, H, P, h_d]``) every row also attends to those P earlier
    positions. Returns the attention output ``[B, S, D]`` and this call's own ``(k, v)``.
    """
    b, s, _ = x.shape
    q = attn.pos_embeddings(attn.q_proj(x).view(b, s, -1, attn.head_dim), input_pos=positions)
    k = attn.pos_embeddings(attn.k_proj(x).view(b, s, -1, attn.head_dim), input_pos=positions)
    v = attn.v_proj(x).view(b, s, -1, attn.head_dim)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, h_d]
    own = (k, v)
    mask = torch.ones(s, s, dtype=torch.bool).tril()  # [S, S], True = may attend
    if prefix_kv is not None:
        prefix_k, prefix_v = prefix_kv
        k = torch.cat([prefix_k.expand(b, -1, -1, -1), k], dim=2)  # [B, H, P + S, h_d]
        v = torch.cat([prefix_v.expand(b, -1, -1, -1), v], dim=2)
        mask = torch.cat([torch.ones(s, prefix_k.size(2), dtype=torch.bool), mask], dim=1)  # [S, P + S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, S, h_d]
    return attn.output_proj(out.transpose(1, 2).reshape(b, s, -1)), own


def shared_prefix_forward(model, prefix: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
    """Last-layer hidden states (before the final norm) of ``prefix + suffix[i]`` on the suffix positions.

    Equals ``model(cat(prefix, suffix[i]))`` restricted to the suffix (checked against it in
    :func:`check_shared_prefix_forward`), but the shared prefix ``[P]`` goes through the layers once
    (batch 1) instead of B times; its keys and values are broadcast to every row. Gradients flow through
    both parts. Written for torchtune's Qwen2 layers (``TransformerSelfAttentionLayer``).

    Args:
        model: the torchtune ``qwen2`` decoder.
        prefix (torch.Tensor): ``[P]`` token ids shared by every row.
        suffix (torch.Tensor): ``[B, S]`` right-padded token ids.

    Returns:
        torch.Tensor: ``[B, S, D]``.
    """
    p, s = prefix.numel(), suffix.size(1)
    x_prefix = model.tok_embeddings(prefix[None])  # [1, P, D]
    x = model.tok_embeddings(suffix)  # [B, S, D]
    prefix_pos, suffix_pos = torch.arange(p), torch.arange(p, p + s)
    for layer in model.layers:
        attn_out, prefix_kv = _self_attention(layer.attn, layer.sa_norm(x_prefix), prefix_pos)
        x_prefix = x_prefix + layer.sa_scale(attn_out)
        x_prefix = x_prefix + layer.mlp_scale(layer.mlp(layer.mlp_norm(x_prefix)))
        attn_out, _ = _self_attention(layer.attn, layer.sa_norm(x), suffix_pos, prefix_kv)
        x = x + layer.sa_scale(attn_out)
        x = x + layer.mlp_scale(layer.mlp(layer.mlp_norm(x)))
    return x


def check_shared_prefix_forward(model, prefix: List[int], examples) -> None:
    """Asserts that :func:`shared_prefix_forward` matches the torchtune model's own forward."""
    attn = model.layers[0].attn
    assert attn.num_heads == attn.num_kv_heads and attn.q_norm is None and attn.k_norm is None
    tokens, _ = collate(examples, pad_id=0)
    prefix_t = torch.tensor(prefix)
    with torch.no_grad(), replace_unembed(model, lambda h: h):
        expected = model(torch.cat([prefix_t.expand(len(examples), -1), tokens], dim=1))[:, len(prefix):]
        got = shared_prefix_forward(model, prefix_t, tokens)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def sft(model, prefix: List[int], examples, *, steps: int, batch_size: int, lr: float, seed: int,
        pad_id: int, log_every: int = 50) -> None:
    """Teacher-forced next-token cross-entropy on completion tokens; AdamW, linear warmup then constant lr."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / WARMUP_STEPS)
    )
    prefix_t = torch.tensor(prefix)
    generator = torch.Generator().manual_seed(seed)
    order: List[int] = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:  # reshuffle once per epoch
            order += torch.randperm(len(examples), generator=generator).tolist()
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        tokens, labels = collate(batch, pad_id)  # [B, S] each
        hidden = shared_prefix_forward(model, prefix_t, tokens)  # [B, S, D]
        # Position t predicts token t + 1. Only completion positions have labels, so the final norm and
        # output projection run on those alone.
        targets = labels[:, 1:]  # [B, S - 1]
        selected = targets != IGNORE_INDEX
        logits = model.output(model.norm(hidden[:, :-1][selected]))  # [n_completion_tokens, V]
        loss = F.cross_entropy(logits.float(), targets[selected])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        if log_every and ((step + 1) % log_every == 0 or step == 0):
            print(f"  step {step + 1:4d}/{steps}  loss {loss.item():.4f}", flush=True)


@torch.no_grad()
def evaluate(model, tokenizer, dataset, *, temperature: float, group_size: int, seed: int,
             max_new_tokens: int = 24, batch_prompts: int = 64) -> Dict[str, float]:
    """Scores generated completions with the recipe's own rewards (``FormatReward``, ``MathAnswerReward``).

    Returns the format rate, the accuracy and, for ``group_size > 1``, the share of prompts whose
    ``group_size`` samples are neither all right nor all wrong (``mixed``: the groups that give GRPO a
    non-zero advantage from the correctness reward).
    """
    was_training = model.training
    model.eval()
    engine = NativeGenerator(temperature=temperature)
    generator = torch.Generator().manual_seed(seed)
    rows = [dataset[i] for i in range(len(dataset))]
    fmt: List[float] = []
    acc: List[float] = []
    for start in range(0, len(rows), batch_prompts):
        chunk = rows[start : start + batch_prompts]
        rollout = engine.generate(
            model,
            [r["tokens"] for r in chunk],
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            pad_id=tokenizer.pad_id,
            stop_tokens=tokenizer.stop_tokens,
            generator=generator,
        )
        batch = RewardBatch(
            prompts=[r["prompt"] for r in chunk for _ in range(group_size)],
            completions=decode_responses(tokenizer, rollout.response_ids),
            completion_ids=rollout.response_ids,
            fields=[{"answer": r["answer"]} for r in chunk for _ in range(group_size)],
        )
        fmt += FormatReward(think_in_prompt=True)(batch)
        acc += MathAnswerReward()(batch)
    model.train(was_training)
    groups = [acc[i : i + group_size] for i in range(0, len(acc), group_size)]
    return {
        "format": sum(fmt) / len(fmt),
        "accuracy": sum(acc) / len(acc),
        "mixed": sum(0 < sum(g) < len(g) for g in groups) / len(groups),
        "n": len(acc),
    }


def report(model, tokenizer, validation, seed: int) -> None:
    """Prints the numbers quoted in the asset's README."""
    # The tiny demo config's prompts: arithmetic_dataset(num_samples=256, max_value=20), seed 0.
    demo = arithmetic_dataset(tokenizer, num_samples=256, max_value=MAX_VALUE, operations=OPERATIONS)
    for name, dataset, temperature, group in (
        ("validation, greedy      ", validation, 0.0, 1),
        ("validation, T=1, G=4    ", validation, 1.0, 4),
        ("demo prompts, greedy    ", demo, 0.0, 1),
        ("demo prompts, T=1, G=4  ", demo, 1.0, 4),
    ):
        m = evaluate(model, tokenizer, dataset, temperature=temperature, group_size=group, seed=seed)
        mixed = f"  mixed groups {m['mixed']:.3f}" if group > 1 else ""
        print(f"{name}: format {m['format']:.3f}  accuracy {m['accuracy']:.3f}{mixed}  (n={m['n']})")


def save_model(model, out: Path) -> None:
    hf_state = qwen2_tune_to_hf(
        model.state_dict(),
        num_heads=tiny.NUM_HEADS,
        num_kv_heads=tiny.NUM_KV_HEADS,
        dim=tiny.EMBED_DIM,
        tie_word_embeddings=True,
    )
    hf_state = {k: v.detach().to(torch.float32).contiguous() for k, v in sorted(hf_state.items())}
    save_file(hf_state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; shipped files must be readable


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=BASE_DIR, help="the tiny_qwen2 asset to start from")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed for data order and evaluation")
    parser.add_argument("--steps", type=int, default=STEPS, help="SFT optimizer steps")
    parser.add_argument("--lr", type=float, default=LR, help="peak learning rate")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per step")
    parser.add_argument("--no-eval", action="store_true", help="skip the final accuracy report")
    args = parser.parse_args(argv)

    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()

    tokenizer = load_tokenizer(args.base)
    train = build_split(tokenizer, "train", seed=args.seed)
    validation = build_split(tokenizer, "validation", seed=args.seed)
    prefix, examples = sft_examples(tokenizer, train)
    print(f"SFT on {len(examples)} train problems (operands {MIN_VALUE}..{MAX_VALUE}, {OPERATIONS}), "
          f"{args.steps} steps x {args.batch_size}, lr {args.lr}")

    model = load_base_model(args.base)
    check_shared_prefix_forward(model, prefix, examples[:4])
    sft(model, prefix, examples, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        pad_id=tokenizer.pad_id)

    args.out.mkdir(parents=True, exist_ok=True)
    save_model(model, args.out)
    for name in COPIED_FILES:
        shutil.copyfile(args.base / name, args.out / name)
        os.chmod(args.out / name, 0o644)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")

    if not args.no_eval:
        report(model, tokenizer, validation, seed=args.seed)
        print(f"done ({time.perf_counter() - t0:.1f} s)")

if __name__ == "__main__":
    main()
