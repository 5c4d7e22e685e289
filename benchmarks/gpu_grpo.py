"""GRPO on a CUDA GPU with Qwen3- (or Qwen2.5-) shaped random models: decode, one GRPO step, the recipe.

Nothing is downloaded. The default models, ``qwen3_0_6b`` and ``qwen3_1_7b``, are random Hugging Face
directories of those shapes (benchmarks/hf_random.py: config.json -> random bf16 safetensors), read through
the one-line model config (``HFCheckpointer`` + ``hf_model`` on ``checkpointer.checkpoint_dir``) as a real
model would be; ``qwen2_5_0_5b`` / ``qwen2_5_1_5b`` are torchtune's builders with random weights (std 0.02,
norms 1). Prompts are random token ids, and the reward is computed on token ids (the fraction of even ids
in a completion), so no tokenizer is needed. Parts (``--parts``, in this order):

- ``ceilings``: the device's measured device-to-device copy bandwidth (bytes read + written) and bf16
  matrix-product rate (8192^3, random data): the bounds the other numbers are compared with.
- ``decode``: ``NativeGenerator`` decode tokens/s at each ``--decode-batch`` (rows, one sample per prompt,
  ``--prompt-len`` prompt tokens, ``--new-tokens`` new tokens, no stop token), with the CUDA-graph decode
  step (``compile_decode=True``) and without it (eager), against the memory-bandwidth bound: every decode
  step must read every weight once (the input embedding only for its rows when untied) and the KV cache of
  every row up to its current position, so
  ``bound = rows / ((weight bytes + rows x mean context x KV bytes per token) / copy bandwidth)``.
  Decode time = ``generate`` with ``--new-tokens`` minus ``generate`` with 1 token (prefill + first sample),
  so it holds ``new_tokens - 1`` steps, each a forward of one token per row plus sampling.
- ``grpo``: one GRPO step on the recipe's own path (without FSDP2): ``NativeGenerator.generate``
  (``--prompts`` x ``--group`` rows) -> reward -> advantages (``GroupRelativeAdvantage``) -> the recipe's
  training layout (``TrainingBatch``, shared prompt, as ``share_prompt_in_training: true``) -> reference
  logprobs (``batch_logprobs``: chunked, micro-batched, frozen copy of the initial policy, as with
  ``kl_coef > 0``) -> the recipe's update core (``torchtune_grpo.training.update.PolicyUpdate``: per micro-batch
  logprobs with grad and logged entropy, ``GRPOLoss`` token-mean with k3 KL 0.04, backward, grad-norm clip
  1.0, AdamW step). Times each phase, tokens/s, peak memory and MFU.
- ``reference``: the KL reference model's device memory, logprob time and logprob difference per
  ``reference:`` mode (full copy, int8, NF4, offloaded): benchmarks/gpu_reference.py (random Hugging Face
  directories only).
- ``recipe``: the real recipe class ``GRPOFullFinetuneRecipeDistributed`` (FSDP2 on one process, as
  ``tune run`` runs it) with the model's shipped config (``configs/qwen3/<size>_full_grpo.yaml``: only
  ``checkpointer.checkpoint_dir`` points at the random directory; ``configs/qwen2_5/...`` with a random
  checkpointer for the builder models), where tokenizer, dataset and reward are the synthetic components
  below and the checkpoint save is skipped; its own ``metrics.jsonl`` gives the step time,
  ``tokens_per_second`` and peak memory.

Tokens counted ("tokens/s") are prompt + completion tokens of the step's sequences, padding excluded (the
recipe's ``tokens_per_second`` counts the same). MFU = 6 x N x tokens / time / peak, with N the parameters
a token's forward multiplies with (all of them for these tied-embedding models: the embedding matrix is the
output projection) and the peak the measured bf16 matrix rate of the ``ceilings`` part (or
``--peak-tflops``); attention score FLOPs and activation-checkpointing recomputation are not counted.

    # on a GPU (scripts/gpu_check.sh runs it with a time budget; docs/gpu.md)
    python benchmarks/gpu_grpo.py --models qwen3_0_6b qwen3_1_7b --json results.json
    # smoke test on CPU (tiny models, fp32, aot_eager instead of inductor for the compiled decode)
    python benchmarks/gpu_grpo.py --device cpu --tiny

Results go in docs/gpu.md and docs/benchmarks/gpu_runs.md, with the device named.
"""

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

import gpu_reference  # benchmarks/ is on sys.path: this script's directory (harness.py)
import hf_random
from harness import recipe_module, REPO

# The GPU machine has no install of this project (scripts/gpu_check.sh): this checkout is imported.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# name -> (module, builder, kwargs) for torchtune builders, or ("hf", shape, {}) for a random Hugging Face
# directory of a hf_random.SHAPES shape.
MODELS = {
    "qwen3_0_6b": ("hf", "qwen3_0_6b", {}),
    "qwen3_1_7b": ("hf", "qwen3_1_7b", {}),
    "tiny_qwen3": ("hf", "tiny_qwen3", {}),
    "qwen2_5_0_5b": ("torchtune.models.qwen2_5", "qwen2_5_0_5b", {}),
    "qwen2_5_1_5b": ("torchtune.models.qwen2_5", "qwen2_5_1_5b_instruct", {}),
    "tiny": (
        "torchtune.models.qwen2",
        "qwen2",
        dict(vocab_size=512, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128,
             intermediate_dim=256, max_seq_len=2048, tie_word_embeddings=True),
    ),
}
# The shipped config each model's recipe run starts from.
RECIPE_CONFIGS = {
    "qwen3_0_6b": "configs/qwen3/0.6B_full_grpo.yaml",
    "qwen3_1_7b": "configs/qwen3/1.7B_full_grpo.yaml",
    "tiny_qwen3": "configs/qwen3/0.6B_full_grpo.yaml",
    "qwen2_5_0_5b": "configs/qwen2_5/0.5B_full_grpo.yaml",
    "qwen2_5_1_5b": "configs/qwen2_5/1.5B_full_grpo.yaml",
    "tiny": "configs/qwen2_5/0.5B_full_grpo.yaml",
}
# Qwen's <|endoftext|> (its pad id) and <|im_end|> (a stop token); small ids for the tiny models.
special_ids = hf_random.special_ids
# Where the random Hugging Face directories are written (--model-dir).
MODEL_DIR = Path(tempfile.gettempdir()) / "gpu_grpo_models"


# ---------------------------------------------------------------------------------------- pure helpers


def weight_bytes_per_decode_step(model: torch.nn.Module, rows: int) -> int:
    """Bytes of weights one decode step must read: every parameter once, the input embedding only for
    its ``rows`` looked-up rows when it is not also the output projection (untied)."""
    emb = model.tok_embeddings.weight
    tied = type(model.output).__name__ == "TiedLinear"
    total = 0
    for p in model.parameters():  # tied weights are yielded once
        if p is emb and not tied:
            total += rows * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys + values one token adds to the KV cache over all layers (model dtype)."""
    size = model.tok_embeddings.weight.element_size()
    return sum(2 * layer.attn.num_kv_heads * layer.attn.head_dim * size for layer in model.layers)


def decode_bound_tokens_per_s(
    weight_bytes: int, kv_per_token: int, rows: int, prompt_len: int, new_tokens: int, bandwidth: float
) -> float:
    """Upper bound on decode tokens/s from memory bandwidth (bytes/s): weights + KV cache up to the mean
    position of the decode steps, read once per step."""
    mean_ctx = prompt_len + new_tokens / 2
    step_bytes = weight_bytes + rows * mean_ctx * kv_per_token
    return rows * bandwidth / step_bytes


def flop_params(model: torch.nn.Module) -> int:
    """N in the 6 N T estimate: parameters multiplied with per token (the input embedding is a lookup,
    so it counts only when it is also the output projection)."""
    emb = model.tok_embeddings.weight
    tied = type(model.output).__name__ == "TiedLinear"
    return sum(p.numel() for p in model.parameters() if tied or p is not emb)


def count_tokens(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> int:
    """Prompt + completion tokens of the step's sequences, padding excluded."""
    return sum(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))


def even_token_reward(response_ids: Sequence[Sequence[int]]) -> List[float]:
    """A verifiable reward on token ids: the fraction of even ids in each completion (0 when empty)."""
    return [sum(1 for t in r if t % 2 == 0) / len(r) if r else 0.0 for r in response_ids]


def random_prompts(num: int, min_len: int, max_len: int, vocab: int, avoid: Sequence[int], seed: int) -> List[List[int]]:
    """``num`` prompts of random ids (none of ``avoid``), lengths uniform in ``[min_len, max_len]``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g)
        for a in avoid:
            ids[ids == a] = 0
        out.append(ids.tolist())
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# ------------------------------------------------------------------ synthetic recipe components


class SyntheticTokenizer:
    """Stands in for the tokenizer in the recipe: ids are their own text (nothing to download)."""

    def __init__(self, vocab_size: int = 151936) -> None:
        self.pad_id, stop = special_ids(vocab_size)
        self.stop_tokens = [stop]
        self.eos_id = stop

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> List[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in ids)


def synthetic_prompt_dataset(
    tokenizer: Any, num_samples: int = 256, min_len: int = 100, max_len: int = 160,
    vocab_size: int = 151936, seed: int = 0,
) -> List[Dict[str, Any]]:
    """Random-id prompts as the recipe's datasets return them: ``{"tokens", "prompt", "answer"}``."""
    prompts = random_prompts(num_samples, min_len, max_len, vocab_size,
                             [tokenizer.pad_id, *tokenizer.stop_tokens], seed)
    return [{"tokens": p, "prompt": "", "answer": ""} for p in prompts]


class EvenTokenReward:
    """Reward component (``RewardBatch -> List[float]``): see :func:`even_token_reward`."""

    def __call__(self, batch: Any) -> List[float]:
        return even_token_reward(batch.completion_ids)


class RandomCheckpointer:
    """Stands in for ``FullModelHFCheckpointer``: a random state dict of the model builder, no files."""

    def __init__(self, model_component: str, output_dir: str, seed: int = 0) -> None:
        self.model_component = model_component
        self._output_dir = Path(output_dir)
        self.seed = seed

    def load_checkpoint(self) -> Dict[str, Any]:
        from torchtune import training

        module, _, fn = self.model_component.rpartition(".")
        torch.manual_seed(self.seed)
        # Initialised on the GPU when there is one (seconds instead of a minute on CPU), returned on CPU.
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        with training.set_default_dtype(torch.bfloat16), device:
            model = getattr(importlib.import_module(module), fn)()
        hf_random.random_init(model)
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        del model
        free_memory()
        return {"model": state}

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - never called
        raise RuntimeError("the benchmark recipe does not save checkpoints")


# ------------------------------------------------------------------------------------------ models


def is_hf(name: str) -> bool:
    """Whether ``name`` is a random Hugging Face directory (else a torchtune builder)."""
    return MODELS[name][0] == "hf"


def model_dir(name: str) -> Path:
    """The random Hugging Face directory of ``name`` (written on first use; on the GPU when there is one)."""
    return hf_random.write_model_dir(MODELS[name][1], MODEL_DIR / name,
                                     device="cuda" if torch.cuda.is_available() else "cpu")


def build_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The model ``name`` on ``device`` in ``dtype``: a builder's with random weights, or the Hugging Face
    directory's through ``hf_model`` + ``HFCheckpointer`` (its saved random weights)."""
    from torchtune import training

    if is_hf(name):
        from torchtune_grpo.models import HFCheckpointer, hf_model

        path = model_dir(name)
        with training.set_default_dtype(dtype), torch.device(device):
            model = hf_model(str(path))
        state = HFCheckpointer(str(path), tempfile.mkdtemp(prefix="gpu_grpo_ckpt_")).load_checkpoint()["model"]
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
        return model
    module, fn, kwargs = MODELS[name]
    torch.manual_seed(seed)
    with training.set_default_dtype(dtype), torch.device(device):
        model = getattr(importlib.import_module(module), fn)(**kwargs)
    hf_random.random_init(model)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- ceilings


def measure_ceilings(device: torch.device) -> Dict[str, Any]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s), medians of event timings."""
    if device.type != "cuda":
        return {}

    def timed(fn, reps: int = 20) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return median(times)

    n = 1 << 29  # 1 GiB of bf16 each way, far past the L2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src))
    copy_gbs = 2 * n * 2 / t_copy / 1e9
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t_mm = timed(lambda: a @ b)
    del a, b
    free_memory()
    return {"copy_gbs": copy_gbs, "matmul_bf16_tflops": 2 * m**3 / t_mm / 1e12}


# ------------------------------------------------------------------------------------------ decode


def measure_decode(
    model: torch.nn.Module, device: torch.device, rows: int, compile_on: bool, args: argparse.Namespace,
    bandwidth: Optional[float],
) -> Dict[str, Any]:
    from torchtune_grpo.generation import NativeGenerator

    vocab = model.tok_embeddings.num_embeddings
    pad_id, stop_id = special_ids(vocab)
    engine = NativeGenerator(
        temperature=1.0, compile_decode=compile_on, stop_check_interval=1 << 30,
        compile_backend="inductor" if device.type == "cuda" else "aot_eager",
    )
    prompts = random_prompts(rows, args.prompt_len, args.prompt_len, vocab, [pad_id, stop_id], seed=rows)

    def run(new_tokens: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        engine.generate(
            model, prompts, group_size=1, max_new_tokens=new_tokens, pad_id=pad_id,
            stop_tokens=[vocab + 1],  # never sampled: every row decodes the full budget
            generator=torch.Generator(device=device).manual_seed(0),
        )
        sync(device)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    run(args.new_tokens)  # warm-up: compilation, CUDA-graph capture, cache allocation
    warmup_s = time.perf_counter() - t0
    full = median([run(args.new_tokens) for _ in range(args.repeats)])
    # A one-token run sizes its KV cache for one token: its first call allocates (and, compiled, may
    # record a new CUDA graph), which once made the "prefill" longer than the whole generation (H200).
    run(1)
    first = median([run(1) for _ in range(args.repeats)])
    steps = args.new_tokens - 1
    if full <= first:
        raise RuntimeError(f"decode time not measurable: {args.new_tokens} tokens took {full:.4f} s, "
                           f"the prefill alone {first:.4f} s")
    decode_s = full - first
    tps = rows * steps / decode_s
    out = {
        "rows": rows,
        "compiled": engine.compiles_decode(device),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "warmup_s": warmup_s,
        "generate_s": full,
        "prefill_s": first,
        "decode_step_ms": decode_s / steps * 1e3,
        "decode_tokens_per_s": tps,
    }
    if bandwidth:
        w = weight_bytes_per_decode_step(model, rows)
        kv = kv_bytes_per_token(model)
        bound = decode_bound_tokens_per_s(w, kv, rows, args.prompt_len, args.new_tokens, bandwidth)
        out.update(
            weight_mb=w / 1e6,
            kv_mb_per_step=rows * (args.prompt_len + args.new_tokens / 2) * kv / 1e6,
            bound_tokens_per_s=bound,
            fraction_of_bound=tps / bound,
            bound_step_ms=rows / bound * 1e3,
        )
    del engine
    free_memory()
    return out


# --------------------------------------------------------------------------------------- GRPO step


def run_grpo(name: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
             peak_flops: Optional[float]) -> Dict[str, Any]:
    from torchtune import modules, training

    from torchtune_grpo.rollouts.advantages import GroupRelativeAdvantage
    from torchtune_grpo.training.experience import ExperienceBuilder, Reference
    from torchtune_grpo.generation import NativeGenerator
    from torchtune_grpo.loss import GRPOLoss
    from torchtune_grpo.loss.masks import LossMasks
    from torchtune_grpo.rollouts.groups import RolloutGroups
    from torchtune_grpo.training.update import PolicyUpdate

    policy = build_model(name, device, dtype, seed=0)
    ref = build_model(name, device, dtype, seed=0)  # the frozen initial policy (kl_coef > 0)
    ref.eval().requires_grad_(False)
    if args.activation_checkpointing:
        training.set_activation_checkpointing(policy, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    vocab = policy.tok_embeddings.num_embeddings
    pad_id, stop_id = special_ids(vocab)
    engine = NativeGenerator(
        temperature=1.0, compile_decode=args.compile_decode,
        compile_backend="inductor" if device.type == "cuda" else "aot_eager",
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5, weight_decay=0.0)
    advantage = GroupRelativeAdvantage(scale_by_std=True)
    loss_fn = GRPOLoss(epsilon=0.2, kl_coef=0.04, kl_estimator="k3", loss_agg_mode="token-mean")
    generator = torch.Generator(device=device).manual_seed(0)
    g, mbs, chunk = args.group, args.micro_batch, args.chunk_size
    n_params = flop_params(policy)
    update = PolicyUpdate(
        policy, optimizer, loss_fn, micro_batch_size=mbs, clip_grad_norm=1.0, chunk_size=chunk,
    )
    # The recipe's experience stage (layout, reference logprobs, advantages, masks), as the recipe builds it.
    build_experience = ExperienceBuilder(
        advantage=advantage, reward_weights=[1.0], group_size=g, pad_id=pad_id, loss_masks=LossMasks(None, None),
        micro_batch_size=mbs, temperature=1.0, device=device, chunk_size=chunk, share_prompt=True, kl_coef=0.04,
        kl_estimator="k3", reference=Reference(ref), update_needs_old_logprobs=update.needs_old_logprobs,
    )

    def step(seed: int) -> Dict[str, Any]:
        prompts = random_prompts(args.prompts, args.min_prompt_len, args.max_prompt_len, vocab,
                                 [pad_id, stop_id], seed)
        sync(device)
        t0 = time.perf_counter()
        policy.eval()
        rollout = engine.generate(policy, prompts, group_size=g, max_new_tokens=args.response_len,
                                  pad_id=pad_id, stop_tokens=[stop_id], generator=generator)
        sync(device)
        t1 = time.perf_counter()
        rewards = torch.tensor(even_token_reward(rollout.response_ids), dtype=torch.float32)
        n = len(rollout.response_ids)
        groups = RolloutGroups(
            group_size=g, prompts=[""] * (n // g), fields=[{} for _ in range(n // g)], prompt_ids=rollout.prompt_ids,
            response_ids=rollout.response_ids, completions=[""] * n, truncated=rollout.truncated, rewards=rewards,
        )
        exp, _ = build_experience(policy, groups)
        sync(device)
        t3 = time.perf_counter()
        stats = update(exp)
        loss_sum, grad_norm = stats.losses["loss"], stats.grad_norm
        sync(device)
        t4 = time.perf_counter()
        times = {"generation": t1 - t0, "experience": t3 - t1, "train": t4 - t3,
                 "step": t4 - t0}
        tok = count_tokens(rollout.prompt_ids, rollout.response_ids)
        resp = sum(len(r) for r in rollout.response_ids)
        return {**{f"time_{k}": v for k, v in times.items()}, "tokens": tok, "response_tokens": resp,
                "padded_tokens": int(exp.batch.tokens.numel()), "loss": float(loss_sum),
                "grad_norm": float(grad_norm), "reward_mean": float(rewards.mean())}

    t0 = time.perf_counter()
    warm = [step(1000 + i) for i in range(args.warmup_steps)]
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = [step(i) for i in range(args.steps)]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    med = {k: median([s[k] for s in steps]) for k in steps[0]}
    tokens = med["tokens"]
    out: Dict[str, Any] = {
        "model": name,
        "params": sum(p.numel() for p in policy.parameters()),
        "flop_params": n_params,
        "prompts": args.prompts, "group": g, "rows": args.prompts * g,
        "prompt_len": [args.min_prompt_len, args.max_prompt_len], "response_len": args.response_len,
        "micro_batch": mbs, "chunk_size": chunk, "activation_checkpointing": args.activation_checkpointing,
        "compile_decode": engine.compiles_decode(device),
        "warmup_steps": args.warmup_steps, "warmup_s": warmup_s, "first_step_s": warm[0]["time_step"] if warm else None,
        "measured_steps": args.steps, "median": med,
        "tokens_per_s": tokens / med["time_step"],
        "response_tokens_per_s_generation": med["response_tokens"] / med["time_generation"],
        "peak_allocated_gib": peak,
        "all_steps": steps,
    }
    if peak_flops:
        train_flops = 6 * n_params * tokens
        out["mfu_train"] = train_flops / med["time_train"] / peak_flops
        # Whole step: training 6N, reference forward 2N per token, generation 2N per generated token.
        step_flops = train_flops + 2 * n_params * tokens + 2 * n_params * med["response_tokens"]
        out["mfu_step"] = step_flops / med["time_step"] / peak_flops
        out["mfu_step_6n_only"] = train_flops / med["time_step"] / peak_flops
    del policy, ref, engine, optimizer, update
    free_memory()
    return out


# ------------------------------------------------------------------------------------------ recipe


def run_recipe(name: str, device: torch.device, args: argparse.Namespace, out_dir: str) -> Dict[str, Any]:
    """The real recipe class on the shipped config, with synthetic tokenizer/checkpoint/data/reward."""
    from omegaconf import OmegaConf

    recipe_mod = recipe_module()

    mod = __name__
    cfg = OmegaConf.load(REPO / RECIPE_CONFIGS[name])
    if is_hf(name):
        vocab = hf_random.SHAPES[MODELS[name][1]]["vocab_size"]
    else:
        vocab = 151936 if name != "tiny" else MODELS["tiny"][2]["vocab_size"]
    overrides = {
        "output_dir": out_dir,
        "model": {"_component_": f"{MODELS[name][0]}.{MODELS[name][1]}", **MODELS[name][2]},
        "tokenizer": {"_component_": f"{mod}.SyntheticTokenizer", "vocab_size": vocab},
        "checkpointer": {"_component_": f"{mod}.RandomCheckpointer",
                         "model_component": f"{MODELS[name][0]}.{MODELS[name][1]}", "output_dir": out_dir},
        "dataset": {"_component_": f"{mod}.synthetic_prompt_dataset",
                    "num_samples": args.prompts * (args.recipe_steps + 1), "min_len": args.min_prompt_len,
                    "max_len": args.max_prompt_len, "vocab_size": vocab},
        "reward_functions": [{"_component_": f"{mod}.EvenTokenReward", "name": "even", "weight": 1.0}],
        "batch_size": args.prompts, "group_size": args.group, "micro_batch_size": args.micro_batch,
        "max_prompt_length": args.max_prompt_len, "max_response_length": args.response_len,
        "max_steps": args.recipe_steps, "save_every_n_steps": None, "log_completions": 0,
        "enable_activation_checkpointing": args.activation_checkpointing,
        "logprob_chunk_size": args.chunk_size,
        "kl_coef": args.kl_coef,  # the same as TRL's beta (benchmarks/hf_random.py --kl-coef)
        "device": device.type, "dtype": args.dtype,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": f"{out_dir}/logs"},
    }
    if name == "tiny":
        overrides["model"] = {"_component_": "torchtune.models.qwen2.qwen2", **MODELS["tiny"][2]}
        overrides["checkpointer"]["model_component"] = f"{mod}._tiny_builder"
    if is_hf(name):  # the shipped config's model and checkpointer, pointed at the directory (one line)
        del overrides["model"], overrides["checkpointer"]
        cfg.checkpointer.checkpoint_dir = str(model_dir(name))
        cfg.checkpointer.output_dir = out_dir
    overrides.update(getattr(args, "recipe_overrides", None) or {})  # a stage's own (benchmarks/gpu_moe.py)
    for k, v in overrides.items():
        cfg[k] = v
    if args.compile_decode is not None:
        cfg.generation.compile_decode = args.compile_decode
    if device.type != "cuda":
        cfg.generation.compile_backend = "aot_eager"

    # A fresh one-process group each run: the recipe sets these, and with RANK set it would think it was
    # launched by torchrun (and leave the process at the end).
    env_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved_env = {key: os.environ.pop(key, None) for key in env_keys}
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # The recipe's own steps through its public train_step(): train() without its checkpoint saves.
        recipe = recipe_mod.GRPOFullFinetuneRecipeDistributed(cfg)
        recipe.setup(cfg)
        recipe.optimizer.zero_grad(set_to_none=True)
        while recipe.global_step < recipe.total_steps:
            recipe.train_step()
        recipe.cleanup()
    finally:
        if torch.distributed.is_initialized():  # a failed run leaves its group behind
            torch.distributed.destroy_process_group()
        for key, value in saved_env.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "tokens_per_second" in r]
    measured = rows[1:] if len(rows) > 1 else rows  # the first step compiles the decode step
    keys = ["time/step", "time/generation", "time/reward", "time/train", "tokens_per_second",
            "memory/peak_allocated_gib", "response_length/mean", "loss", "kl"]
    with torch.device("meta"):
        n_params = flop_params(_builder(name)())
    return {
        "model": name, "config": RECIPE_CONFIGS[name], "steps": len(rows), "wall_s": wall,
        "flop_params": n_params,
        "first_step_s": rows[0].get("time/step"),
        "median": {k: median([r[k] for r in measured if k in r]) for k in keys},
        "all_steps": rows,
    }


def _builder(name: str):
    if is_hf(name):
        from torchtune_grpo.models import hf_model

        return lambda: hf_model(str(model_dir(name)))
    module, fn, kwargs = MODELS[name]
    return lambda: getattr(importlib.import_module(module), fn)(**kwargs)


def _tiny_builder() -> torch.nn.Module:
    return _builder("tiny")()


# --------------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    global MODEL_DIR
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3_0_6b", "qwen3_1_7b"], choices=list(MODELS))
    parser.add_argument("--parts", nargs="+", default=["ceilings", "decode", "grpo", "recipe"],
                        choices=["ceilings", "decode", "grpo", "reference", "recipe"],
                        help="ceilings first; the rest per model, in this order")
    parser.add_argument("--reference-rows", type=int, default=16, help="rows of the reference part's logprob pass")
    parser.add_argument("--reference-len", type=int, default=1024, help="tokens per row of that pass")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model and small shapes")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--decode-compile", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    hf_random.add_workload_args(parser, steps=3)  # the same workload as benchmarks/gpu_trl.py
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--compile-decode", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--recipe-steps", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak; default: measured")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="copy bandwidth; default: measured")
    parser.add_argument("--json", default=None, help="write all results here (rewritten after each part)")
    parser.add_argument("--model-dir", default=str(MODEL_DIR), help="where the random HF directories go")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: parts that would start later are skipped (and listed as such)")
    args = parser.parse_args(argv)
    MODEL_DIR = Path(args.model_dir)
    args.compile_decode = {"auto": None, "on": True, "off": False}[args.compile_decode]
    if args.tiny:
        args.models = list(dict.fromkeys("tiny_qwen3" if is_hf(m) else "tiny" for m in args.models))
        args.decode_batch = [1, 8]
        args.prompt_len, args.new_tokens, args.repeats = 16, 12, 1
        hf_random.use_tiny_workload(args)
        args.chunk_size, args.steps, args.recipe_steps = 64, 2, 2
        args.reference_rows, args.reference_len = 4, 32
    device = torch.device(args.device)
    # Every decode shape and model is a new graph of the same function: stay compiled past dynamo's
    # default limit of 8 rather than silently falling back to eager.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    results: Dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "decode": [], "grpo": [], "recipe": [], "reference": [], "errors": [], "skipped": [],
                               "part_seconds": {}}
    started = time.perf_counter()

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    def attempt(label: str, fn):
        if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
            print(f"=== {label}: skipped (time budget of {args.time_budget:.0f} s spent)", flush=True)
            results["skipped"].append(label)
            save()
            return None
        print(f"=== {label}", flush=True)
        t0 = time.perf_counter()
        try:
            r = fn()
            print(json.dumps({k: v for k, v in r.items() if k != "all_steps"}, default=str), flush=True)
            return r
        except Exception as e:  # noqa: BLE001 - report and go on with the other parts
            traceback.print_exc()
            results["errors"].append({"part": label, "error": f"{type(e).__name__}: {e}",
                                      "traceback": traceback.format_exc()[-3000:]})
            free_memory()
            return None
        finally:
            results["part_seconds"][label] = time.perf_counter() - t0
            save()

    print(f"torch {torch.__version__}, device {results['device']}", flush=True)
    if "ceilings" in args.parts:
        results["ceilings"] = attempt("ceilings", lambda: measure_ceilings(device)) or {}
    ceil = results.get("ceilings", {})
    bandwidth = (args.bandwidth_gbs or ceil.get("copy_gbs") or 0) * 1e9 or None
    peak_flops = (args.peak_tflops or ceil.get("matmul_bf16_tflops") or 0) * 1e12 or None

    def decode_part(name: str) -> None:
        model = build_model(name, device, dtype).eval()
        for compile_mode in args.decode_compile:
            for rows in args.decode_batch:
                r = attempt(f"decode {name} rows={rows} compile={compile_mode}",
                            lambda: measure_decode(model, device, rows, compile_mode == "on", args, bandwidth))
                if r:
                    results["decode"].append({"model": name, **r})
        del model
        free_memory()

    def recipe_part(name: str) -> None:
        out_dir = tempfile.mkdtemp(prefix=f"gpu_grpo_recipe_{name}_")
        r = attempt(f"recipe {name}", lambda: run_recipe(name, device, args, out_dir))
        if r:
            if peak_flops:
                # The recipe's time/train also holds the reference forward: quote the whole step.
                r["mfu_step_6n_only"] = 6 * r["flop_params"] * r["median"]["tokens_per_second"] / peak_flops
            results["recipe"].append(r)

    # Per model, the parts in the order given (with a time budget, the first ones get the time).
    for name in args.models:
        for part in (p for p in args.parts if p != "ceilings"):
            if part == "decode":
                if args.time_budget is None or time.perf_counter() - started <= args.time_budget:
                    decode_part(name)
                else:
                    results["skipped"].append(f"decode {name}")
            elif part == "grpo":
                r = attempt(f"grpo {name}", lambda: run_grpo(name, device, dtype, args, peak_flops))
                if r:
                    results["grpo"].append(r)
            elif part == "reference":
                r = attempt(f"reference {name}", lambda: {"model": name, **gpu_reference.measure_reference(
                    str(model_dir(name)), device, dtype, args.reference_rows, args.reference_len, args.chunk_size)})
                if r:
                    results["reference"].append(r)
                free_memory()
            else:
                recipe_part(name)
    try:
        from torch._dynamo.utils import counters

        results["dynamo"] = {"stats": dict(counters["stats"]), "graph_breaks": dict(counters["graph_break"]),
                             "recompiles": dict(counters.get("recompiles", {}))}
    except Exception:  # noqa: BLE001 - diagnostics only
        pass
    print_summary(results)
    save()
    return results


def print_summary(results: Dict[str, Any]) -> None:
    print("\n==== summary", results["device"], "torch", results["torch"])
    if results.get("ceilings"):
        c = results["ceilings"]
        print(f"copy {c['copy_gbs']:.0f} GB/s, bf16 matmul {c['matmul_bf16_tflops']:.0f} TFLOP/s")
    for r in results["decode"]:
        bound = f"{r['bound_tokens_per_s']:.0f} ({r['fraction_of_bound']:.0%})" if "bound_tokens_per_s" in r else "n/a"
        print(f"decode {r['model']:14s} rows {r['rows']:4d} compiled={r['compiled']!s:5s} "
              f"{r['decode_tokens_per_s']:10.0f} tok/s {r['decode_step_ms']:7.2f} ms/step bound {bound}")
    for r in results["grpo"]:
        m = r["median"]
        mfu = f" MFU train {r['mfu_train']:.1%} step {r['mfu_step']:.1%}" if "mfu_train" in r else ""
        peak = f" peak {r['peak_allocated_gib']:.1f} GiB" if r["peak_allocated_gib"] is not None else ""
        print(f"grpo {r['model']:14s} step {m['time_step']:.2f} s (gen {m['time_generation']:.2f}, experience "
              f"{m['time_experience']:.2f}, train {m['time_train']:.2f}) {r['tokens_per_s']:.0f} tok/s{peak}{mfu}")
    for r in results["recipe"]:
        m = r["median"]
        print(f"recipe {r['model']:14s} step {m['time/step']:.2f} s (gen {m['time/generation']:.2f}, train "
              f"{m['time/train']:.2f}) {m['tokens_per_second']:.0f} tok/s peak {m.get('memory/peak_allocated_gib')} GiB"
              + (f" MFU(6N, step) {r['mfu_step_6n_only']:.1%}" if "mfu_step_6n_only" in r else ""))
    for r in results["reference"]:
        for mode, m in r["modes"].items():
            print(f"reference {r['model']:14s} {mode:16s} held {m['held_gib']:.2f} GiB peak {m['peak_gib']} GiB "
                  f"logprobs {m['logprob_s']:.2f} s, |diff| mean {m['logprob_abs_diff_mean']:.2e}")
    if results.get("dynamo"):
        print("dynamo:", json.dumps(results["dynamo"], default=str)[:1500])
    for e in results["errors"]:
        print("ERROR", e["part"], e["error"])


if __name__ == "__main__":
    main()
