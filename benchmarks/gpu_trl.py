"""TRL's GRPOTrainer on the GPU check's random model and batch: the other side of the step-time ratio.

The same random Hugging Face directory as benchmarks/gpu_grpo.py's ``recipe`` part (``--model``, written by
benchmarks/hf_random.py, its tokenizer mapping each id to its own word), the same batch (``--prompts``
prompts of ``--min-prompt-len``..``--max-prompt-len`` random ids x ``--group`` completions of at most
``--response-len`` tokens, temperature 1, stopping at the model's stop id) and the same update settings as
the shipped Qwen3 configs the recipe part runs: AdamW lr 1e-6, no weight decay, grad-norm clip 1.0, KL
coefficient 0.04 to a frozen reference (``beta``; ``--kl-coef``, 0: no reference, as the shipped
Qwen3-30B-A3B full config), token-mean loss (TRL ``loss_type="dapo"``), one
optimizer step per generation round (on-policy), micro-batches of ``--micro-batch`` sequences (TRL
``per_device_train_batch_size``, with ``gradient_accumulation_steps`` = rows / micro-batch, so one step
generates all rows once), activation checkpointing on, fp32 master weights with bf16 compute on CUDA
(``bf16=True`` on an fp32 model: autocast). Generation is transformers' ``generate`` (TRL's default without
vLLM). The reward is the fraction of even ids in a completion, as on our side.

**Step time** is the wall time between the ends of consecutive optimizer steps; the first step (warm-up) is
excluded and the median of the rest reported. ``tokens/s`` counts prompt + completion tokens (TRL's
``num_tokens``) per median step.

    python benchmarks/gpu_trl.py --model qwen3_0_6b --json trl.json          # on a GPU
    python benchmarks/gpu_trl.py --device cpu --tiny --json trl.json          # CPU rehearsal
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

import hf_random  # benchmarks/ is on sys.path: this script's directory (harness.py)


def prompt_texts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> List[str]:
    """``num`` prompts of random ids (never the pad or stop id) as the id tokenizer's text."""
    g = torch.Generator().manual_seed(seed)
    avoid = set(hf_random.special_ids(vocab))
    out = []
    for n in torch.randint(min_len, max_len + 1, (num,), generator=g).tolist():
        ids = [0 if t in avoid else t for t in torch.randint(0, vocab, (n,), generator=g).tolist()]
        out.append(" ".join(map(str, ids)))
    return out


def even_id_reward(prompts, completions, completion_ids, **kwargs) -> List[float]:
    """TRL reward function: the fraction of even ids in each completion (0 when empty)."""
    return [sum(1 for t in ids if t % 2 == 0) / len(ids) if len(ids) else 0.0 for ids in completion_ids]


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    shape = args.model
    directory = hf_random.write_model_dir(shape, Path(args.model_dir) / shape,
                                          device="cuda" if torch.cuda.is_available() else "cpu")
    vocab = hf_random.SHAPES[shape]["vocab_size"]
    rows = args.prompts * args.group
    if rows % args.micro_batch:
        raise ValueError(f"--micro-batch {args.micro_batch} must divide prompts x group = {rows}")
    steps = args.warmup_steps + args.steps
    texts = prompt_texts(args.prompts * steps, args.min_prompt_len, args.max_prompt_len, vocab, seed=0)
    ends: List[float] = []
    logs: List[Dict[str, float]] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                logs_list.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    logs_list = logs
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=rows // args.micro_batch,  # one generation round per optimizer step
            num_generations=args.group,
            max_completion_length=args.response_len,
            learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, optim="adamw_torch", beta=args.kl_coef, epsilon=0.2, loss_type="dapo",
            num_iterations=1, temperature=1.0, top_p=1.0, top_k=0, max_steps=steps, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=not cuda, bf16=cuda and args.dtype == "bf16",
            fp16=False, gradient_checkpointing=args.activation_checkpointing, shuffle_dataset=False, seed=0,
            dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
        )
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=[even_id_reward], args=config,
            train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
            processing_class=tokenizer, callbacks=[Timer()],
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.train()
    step_times = [b - a for a, b in zip([start] + ends[:-1], ends)]
    measured = step_times[args.warmup_steps:] or step_times
    step_logs = [entry for entry in logs if "num_tokens" in entry]
    cumulative = [entry["num_tokens"] for entry in step_logs]
    tokens = [c - p for c, p in zip(cumulative, [0.0] + cumulative[:-1])]
    median_step = statistics.median(measured)
    median_tokens = statistics.median(tokens[args.warmup_steps:] or tokens) if tokens else float("nan")
    return {
        "model": shape, "trl": trl.__version__, "device": args.device, "dtype": args.dtype, "kl_coef": args.kl_coef,
        "prompts": args.prompts, "group": args.group, "rows": rows, "micro_batch": args.micro_batch,
        "prompt_len": [args.min_prompt_len, args.max_prompt_len], "response_len": args.response_len,
        "activation_checkpointing": args.activation_checkpointing,
        "warmup_steps": args.warmup_steps, "step_times": step_times, "median_step_s": median_step,
        "tokens_per_step": median_tokens, "tokens_per_s": median_tokens / median_step,
        "completion_mean_length": [entry.get("completions/mean_length") for entry in step_logs],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_0_6b", choices=list(hf_random.SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: the tiny shape and batch")
    hf_random.add_workload_args(parser, steps=2)  # the same workload as benchmarks/gpu_grpo.py
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "gpu_grpo_models"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.tiny:  # the same shapes as gpu_grpo.py --tiny
        args.model = "tiny_qwen3"
        hf_random.use_tiny_workload(args)
        args.steps = 1
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    result = run(args)
    print(json.dumps({k: v for k, v in result.items()}, default=str), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
