"""Side-by-side GRPO benchmark: this project's recipe vs TRL's ``GRPOTrainer``, on the same workload.

One invocation builds each workload once (random weights exported in Hugging Face format, the tiny byte-level
BPE tokenizer, the arithmetic prompts as text) and then runs the two trainers alternately, A B A B ..., each
run in its own fresh subprocess so that peak memory is per trainer. Both sides get the same weights,
prompts (in the same order), group size, completion budget, learning rate, optimizer (AdamW, no weight
decay, grad-norm clip 1.0, constant LR), precision (fp32), reward function (this project's reward set,
called from TRL through a wrapper), and no KL term (``kl_coef = 0`` / ``beta = 0``), one optimizer step per
generation round, the whole batch in one micro-batch, no activation checkpointing.

    # TRL is a benchmark-only dependency: install it apart from the training environment
    python -m venv /work/bench-venv --system-site-packages
    /work/bench-venv/bin/pip install "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" -e ".[bench]"
    python benchmarks/grpo_vs_trl.py --trl-python /work/bench-venv/bin/python --rounds 2
    # our side with config overrides, as on tune run's command line (e.g. FSDP2 on the one process)
    python benchmarks/grpo_vs_trl.py --trl-python /work/bench-venv/bin/python --ours-set fsdp_single_process=true

Step time is the wall time between the ends of consecutive optimizer steps (so everything a step does is
in it: data, generation, rewards, logprobs, backward, optimizer, logging), the first step (warm-up) is
excluded, and the median over all measured steps of all rounds is reported. Tokens/s counts prompt and
completion tokens of the step's sequences. Peak memory is the child process's peak RSS (``ru_maxrss``
from ``wait4``) and, separately, the peak RSS sampled while training (after the model is loaded).

Our side runs the real recipe class (``GRPOFullFinetuneRecipeDistributed`` with its shipped defaults, as
``tune run`` runs it on one process: a one-process group, the plain model) in-process in the child; the
child runs the steps itself through the recipe's public ``train_step()`` (``train()`` without its
checkpoint saves: TRL saves nothing either), taking a timestamp after each.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from harness import current_rss, loadavg, recipe_module, RssSampler, run_child as run_script, write_report

# Stop tokens of the tiny tokenizer (<|im_end|>, <|endoftext|>) and its pad id (<|endoftext|>).
STOP_TOKENS = [482, 480]
PAD_ID = 480

REWARD_FUNCTIONS = [
    {"_component_": "torchtune_grpo.rewards.FormatReward", "name": "format", "weight": 0.5},
    {"_component_": "torchtune_grpo.rewards.MathAnswerReward", "name": "correctness", "weight": 1.0},
]

# Each workload: model shape (torchtune builder kwargs), its HF config, and the GRPO batch.
WORKLOADS: Dict[str, Dict[str, Any]] = {
    # A tiny Qwen2-shaped model: 4 layers, 128 wide, GQA (4 query / 2 key-value heads), vocab 512.
    "tiny": {
        "family": "qwen2",
        "model": {
            "vocab_size": 512,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "embed_dim": 128,
            "intermediate_dim": 256,
            "max_seq_len": 1024,
            "norm_eps": 1e-6,
            "rope_base": 1000000.0,
            "tie_word_embeddings": True,
        },
        "batch_size": 4,
        "group_size": 8,
        "max_new_tokens": 64,
        "steps": 6,
        "lr": 1e-5,
    },
    # A ~100M-parameter Llama-3.2-shaped model: 12 layers, 768 wide, 12/4 heads, tied 32k vocabulary.
    "llama100m": {
        "family": "llama3_2",
        "model": {
            "vocab_size": 32000,
            "num_layers": 12,
            "num_heads": 12,
            "num_kv_heads": 4,
            "embed_dim": 768,
            "intermediate_dim": 2048,
            "max_seq_len": 8192,
            "norm_eps": 1e-5,
            "rope_base": 500000,
            "scale_factor": 32,
            "tie_word_embeddings": True,
        },
        "batch_size": 2,
        "group_size": 4,
        "max_new_tokens": 32,
        "steps": 4,
        "lr": 1e-5,
    },
    # Real shapes for a GPU (not in the default CPU run): Qwen2.5-0.5B and -1.5B, random
    # weights, with the tiny tokenizer (ids above its 512 tokens decode to nothing; lengths are unaffected).
    "qwen2_5_0_5b": {
        "family": "qwen2",
        "model": {
            "vocab_size": 151936,
            "num_layers": 24,
            "num_heads": 14,
            "num_kv_heads": 2,
            "embed_dim": 896,
            "intermediate_dim": 4864,
            "max_seq_len": 4096,
            "norm_eps": 1e-6,
            "rope_base": 1000000.0,
            "tie_word_embeddings": True,
        },
        "batch_size": 32,
        "group_size": 8,
        "max_new_tokens": 256,
        "steps": 6,
        "lr": 1e-6,
    },
    "qwen2_5_1_5b": {
        "family": "qwen2",
        "model": {
            "vocab_size": 151936,
            "num_layers": 28,
            "num_heads": 12,
            "num_kv_heads": 2,
            "embed_dim": 1536,
            "intermediate_dim": 8960,
            "max_seq_len": 4096,
            "norm_eps": 1e-6,
            "rope_base": 1000000.0,
            "tie_word_embeddings": True,
        },
        "batch_size": 16,
        "group_size": 8,
        "max_new_tokens": 256,
        "steps": 6,
        "lr": 1e-6,
    },
}
# Long-tailed completion lengths (docs/benchmarks/long_tails.md): the tiny model, whose near-uniform
# next-token distribution over 512 ids with 2 stop ids makes lengths geometric (mean ~256, median ~177,
# 1.8 % cut at 1,024), so every batch holds a few completions several times longer than most; both sides
# sample them.
WORKLOADS["tiny_longtail"] = {
    **WORKLOADS["tiny"],
    "model": {**WORKLOADS["tiny"]["model"], "max_seq_len": 2048},
    "max_new_tokens": 1024,
    "steps": 4,
}
CPU_WORKLOADS = ["tiny", "llama100m"]

NUM_PROMPTS = 64
MAX_VALUE = 20


# ------------------------------------------------------------------------------------------ workload


def hf_config(spec: Dict[str, Any]) -> Dict[str, Any]:
    """The Hugging Face ``config.json`` of a workload's model."""
    m = spec["model"]
    common = {
        "vocab_size": m["vocab_size"],
        "hidden_size": m["embed_dim"],
        "intermediate_size": m["intermediate_dim"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"],
        "num_key_value_heads": m["num_kv_heads"],
        "max_position_embeddings": m["max_seq_len"],
        "rms_norm_eps": m["norm_eps"],
        "rope_theta": m["rope_base"],
        "tie_word_embeddings": m["tie_word_embeddings"],
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "bos_token_id": PAD_ID,
        "eos_token_id": STOP_TOKENS,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if spec["family"] == "qwen2":
        return {
            **common,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": m["num_layers"],
        }
    rope = {
        "rope_type": "llama3",
        "factor": float(m["scale_factor"]),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return {
        **common,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": m["embed_dim"] // m["num_heads"],
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": rope,
        "rope_parameters": {**rope, "rope_theta": m["rope_base"]},
    }


def build_tune_model(spec: Dict[str, Any]):
    """The workload's torchtune model (random weights not yet set)."""
    if spec["family"] == "qwen2":
        from torchtune.models.qwen2 import qwen2

        return qwen2(**spec["model"])
    from torchtune.models.llama3_2 import llama3_2

    return llama3_2(**spec["model"])


def tune_to_hf(spec: Dict[str, Any], state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """torchtune -> Hugging Face parameter names and layouts (torchtune's own converters)."""
    m = spec["model"]
    if spec["family"] == "qwen2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        return qwen2_tune_to_hf(
            state_dict,
            num_heads=m["num_heads"],
            num_kv_heads=m["num_kv_heads"],
            dim=m["embed_dim"],
            tie_word_embeddings=m["tie_word_embeddings"],
        )
    from torchtune.models.convert_weights import tune_to_hf as llama_tune_to_hf

    return llama_tune_to_hf(
        state_dict, num_heads=m["num_heads"], num_kv_heads=m["num_kv_heads"], dim=m["embed_dim"]
    )


def checkpointer_model_type(spec: Dict[str, Any]) -> str:
    return "QWEN2" if spec["family"] == "qwen2" else "LLAMA3_2"


def tokenizer_files() -> Dict[str, str]:
    from torchtune_grpo.assets import asset_path

    names = ["vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"]
    return {name: asset_path("tiny_qwen2", name) for name in names}


def build_tokenizer(workload_dir: Path):
    """The torchtune tokenizer our recipe uses (the shipped tiny byte-level BPE)."""
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    return qwen2_5_tokenizer(
        path=str(workload_dir / "vocab.json"),
        merges_file=str(workload_dir / "merges.txt"),
        special_tokens_path=str(workload_dir / "tokenizer.json"),
        max_seq_len=None,
    )


def dataset_kwargs() -> Dict[str, Any]:
    return {"num_samples": NUM_PROMPTS, "max_value": MAX_VALUE, "seed": 0, "max_prompt_length": 256}


def build_workload(name: str, workload_dir: Path, spec: Optional[Dict[str, Any]] = None, seed: int = 0) -> Path:
    """Write a workload: ``model.safetensors`` + ``config.json`` (HF), tokenizer files, ``prompts.jsonl``.

    The weights are drawn once (normal, std 0.02, like Hugging Face's initialisation; norms at 1) and both
    trainers load this one file: ours through torchtune's ``FullModelHFCheckpointer``, TRL through
    ``AutoModelForCausalLM.from_pretrained``. ``prompts.jsonl`` holds the arithmetic prompts as text, with
    the token ids our tokenizer gives them; TRL re-tokenises the text, which must give the same ids.

    Args:
        name (str): workload name (a key of :data:`WORKLOADS` unless ``spec`` is given).
        workload_dir (Path): output directory (created).
        spec (Optional[Dict[str, Any]]): the workload; defaults to ``WORKLOADS[name]``.
        seed (int): weight seed. Default is 0.

    Returns:
        Path: ``workload_dir``.
    """
    import torch
    from safetensors.torch import save_file

    from torchtune_grpo.data import arithmetic_dataset

    spec = spec or WORKLOADS[name]
    workload_dir = Path(workload_dir)
    workload_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = build_tune_model(spec)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "scale" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    hf_state = {k: v.contiguous() for k, v in tune_to_hf(spec, model.state_dict()).items()}
    save_file(hf_state, str(workload_dir / "model.safetensors"), metadata={"format": "pt"})
    (workload_dir / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    (workload_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": PAD_ID, "eos_token_id": STOP_TOKENS, "pad_token_id": PAD_ID}, indent=2)
    )
    for fname, src in tokenizer_files().items():
        shutil.copyfile(src, workload_dir / fname)

    tokenizer = build_tokenizer(workload_dir)
    dataset = arithmetic_dataset(tokenizer, **dataset_kwargs())
    with open(workload_dir / "prompts.jsonl", "w", encoding="utf-8") as f:
        for i in range(len(dataset)):
            sample = dataset[i]
            text = tokenizer.decode(sample["tokens"], skip_special_tokens=False)
            f.write(json.dumps({"prompt": text, "answer": sample["answer"], "tokens": sample["tokens"]}) + "\n")
    (workload_dir / "workload.json").write_text(json.dumps({"name": name, **spec}, indent=2))
    return workload_dir


def read_prompts(workload_dir: Path) -> List[Dict[str, Any]]:
    with open(Path(workload_dir) / "prompts.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def recipe_config(
    workload_dir: Path,
    output_dir: Path,
    spec: Dict[str, Any],
    steps: int,
    device: str = "cpu",
    dtype: str = "fp32",
) -> Dict[str, Any]:
    """Our recipe's config for a workload (the same keys as ``configs/tiny/full_grpo_cpu.yaml``)."""
    family = spec["family"]
    component = "torchtune.models.qwen2.qwen2" if family == "qwen2" else "torchtune.models.llama3_2.llama3_2"
    b, g = spec["batch_size"], spec["group_size"]
    return {
        "output_dir": str(output_dir),
        "model": {"_component_": component, **spec["model"]},
        "tokenizer": {
            "_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
            "path": str(workload_dir / "vocab.json"),
            "merges_file": str(workload_dir / "merges.txt"),
            "special_tokens_path": str(workload_dir / "tokenizer.json"),
            "max_seq_len": None,
        },
        "checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(workload_dir),
            "checkpoint_files": ["model.safetensors"],
            "model_type": checkpointer_model_type(spec),
            "output_dir": str(output_dir),
        },
        "resume_from_checkpoint": False,
        "dataset": {"_component_": "torchtune_grpo.data.arithmetic_dataset", **dataset_kwargs()},
        "seed": 0,
        "shuffle": False,  # prompts in dataset order, as TRL's shuffle_dataset=False gives them
        "batch_size": b,
        "group_size": g,
        "micro_batch_size": b * g,
        "max_prompt_length": 256,
        "max_response_length": spec["max_new_tokens"],
        "ppo_epochs": 1,
        "epochs": 1,
        "max_steps": steps,
        "generation": {
            "_component_": "torchtune_grpo.generation.NativeGenerator",
            "temperature": 1.0,
            "top_k": None,
            "top_p": 1.0,
        },
        "reward_functions": REWARD_FUNCTIONS,
        "reward_fallback": 0.0,
        "advantage": {"_component_": "torchtune_grpo.rollouts.advantages.GroupRelativeAdvantage", "scale_by_std": True},
        "kl_coef": 0.0,
        "loss": {"_component_": "torchtune_grpo.loss.GRPOLoss", "epsilon": 0.2, "loss_agg_mode": "token-mean"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": spec["lr"], "weight_decay": 0.0},
        "lr_scheduler": None,
        "clip_grad_norm": 1.0,
        "device": device,
        "dtype": dtype,
        "enable_activation_checkpointing": False,
        "logprob_chunk_size": 512,
        "save_every_n_steps": None,
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": str(output_dir / "logs"),
        },
        "log_every_n_steps": 1,
        "log_completions": 0,
    }


# ------------------------------------------------------------------------------------- child processes


def run_ours(
    workload_dir: Path,
    steps: int,
    result_path: Path,
    device: str = "cpu",
    dtype: str = "fp32",
    overrides: Optional[List[str]] = None,
) -> None:
    """Child: our recipe, in-process, on the workload; writes per-step timestamps and token counts.

    ``overrides``: ``key=value`` config overrides (dotted keys, YAML values), as on ``tune run``'s command line.
    """
    import torch
    from omegaconf import OmegaConf

    spec = json.loads((workload_dir / "workload.json").read_text())
    with tempfile.TemporaryDirectory() as out:
        cfg = OmegaConf.create(recipe_config(workload_dir, Path(out), spec, steps, device, dtype))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides or [])))
        recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
        recipe.setup(cfg=cfg)
        ends: List[float] = []
        cpu_ends: List[float] = []
        tokens: List[float] = []
        completion_tokens: List[float] = []
        rss_start = current_rss()
        recipe.optimizer.zero_grad(set_to_none=True)  # as recipe.train(), without its checkpoint I/O (TRL saves none)
        start = time.perf_counter()
        with RssSampler() as sampler:
            while recipe.global_step < recipe.total_steps:
                metrics = recipe.train_step().metrics
                ends.append(time.perf_counter())
                cpu_ends.append(time.process_time())
                n = spec["batch_size"] * spec["group_size"]
                tokens.append(float(metrics["tokens_per_second"] * metrics["time/step"]))
                completion_tokens.append(float(metrics["response_length/mean"] * n))
        recipe.cleanup()
    result = {
        "side": "ours",
        "start": start,
        "ends": ends,
        "cpu_ends": cpu_ends,
        "tokens": tokens,
        "completion_tokens": completion_tokens,
        "rss_train_start": rss_start,
        "rss_train_peak": sampler.peak,
        "torch_threads": torch.get_num_threads(),
    }
    result_path.write_text(json.dumps(result))


def run_trl(workload_dir: Path, steps: int, result_path: Path, device: str = "cpu", dtype: str = "fp32") -> None:
    """Child: TRL's GRPOTrainer on the workload (run with a Python that has ``trl`` installed)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from torchtune_grpo.rewards import RewardBatch, build_reward_set

    spec = json.loads((workload_dir / "workload.json").read_text())
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in read_prompts(workload_dir)]
    reward_set = build_reward_set(REWARD_FUNCTIONS, fallback=0.0)

    def grpo_reward(prompts, completions, completion_ids, answer, **kwargs):
        batch = RewardBatch(
            prompts=list(prompts),
            completions=list(completions),
            completion_ids=[list(c) for c in completion_ids],
            fields=[{"answer": a} for a in answer],
        )
        return [float(x) for x in reward_set(batch).total.tolist()]

    ends: List[float] = []
    cpu_ends: List[float] = []
    logs: List[Dict[str, Any]] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                logs_copy = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                logs_list.append(logs_copy)

    logs_list = logs
    b, g = spec["batch_size"], spec["group_size"]
    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=b * g,  # completions per device per step: B prompts x G
            gradient_accumulation_steps=1,
            num_generations=g,
            max_completion_length=spec["max_new_tokens"],
            learning_rate=spec["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch",
            beta=0.0,
            epsilon=0.2,
            num_iterations=1,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=device == "cpu",
            bf16=dtype == "bf16",
            fp16=False,
            gradient_checkpointing=False,
            shuffle_dataset=False,
            seed=0,
            dataloader_num_workers=0,
            log_completions=False,
            disable_tqdm=True,
        )
        model = AutoModelForCausalLM.from_pretrained(
            str(workload_dir), dtype=torch.bfloat16 if dtype == "bf16" else torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(workload_dir))
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=[grpo_reward],
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[Timer()],
        )
        rss_start = current_rss()
        start = time.perf_counter()
        with RssSampler() as sampler:
            trainer.train()
    # TRL logs the cumulative number of prompt + completion tokens (attention-mask sum) as num_tokens.
    step_logs = [l for l in logs if "num_tokens" in l]
    cumulative = [l["num_tokens"] for l in step_logs]
    tokens = [c - p for c, p in zip(cumulative, [0.0] + cumulative[:-1])]
    n = b * g
    completion_tokens = [l.get("completions/mean_length", 0.0) * n for l in step_logs]
    result = {
        "side": "trl",
        "trl_version": trl.__version__,
        "start": start,
        "ends": ends,
        "cpu_ends": cpu_ends,
        "tokens": tokens,
        "completion_tokens": completion_tokens,
        "rss_train_start": rss_start,
        "rss_train_peak": sampler.peak,
        "torch_threads": torch.get_num_threads(),
    }
    result_path.write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------ parent


def run_child(
    python: str,
    side: str,
    workload_dir: Path,
    steps: int,
    threads: int,
    device: str = "cpu",
    dtype: str = "fp32",
    overrides: Optional[List[str]] = None,
) -> Dict[str, Any]:
    """Run one side in a fresh process; add its peak RSS (``ru_maxrss`` via ``wait4``).

    ``overrides`` (``key=value``) change our recipe's config; TRL's side takes none.
    """
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        args = [
            f"_child_{side}", str(workload_dir), str(steps), str(result_path), device, dtype,
            json.dumps(list(overrides or []) if side == "ours" else []),
        ]
        child = run_script(python, Path(__file__).resolve(), args, threads=threads)
        result = json.loads(result_path.read_text())
    result["peak_rss"] = child.peak_rss
    result["wall"] = child.seconds
    return result


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Median step time (warm-up step of each run excluded), tokens/s, memory over a side's runs."""
    step_times, cpu_times, tokens, completion_tokens = [], [], [], []
    for r in runs:
        ends = r["ends"]
        step_times += [b - a for a, b in zip(ends[:-1], ends[1:])]
        cpu_times += [b - a for a, b in zip(r["cpu_ends"][:-1], r["cpu_ends"][1:])]
        tokens += r["tokens"][1 : len(ends)]
        completion_tokens += r["completion_tokens"][1 : len(ends)]
    median = statistics.median(step_times)
    return {
        "runs": len(runs),
        "steps_measured": len(step_times),
        "step_time_median_s": median,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        # CPU seconds (all threads) per step: less sensitive than wall time to other load on the machine.
        "step_cpu_time_median_s": statistics.median(cpu_times),
        "tokens_per_step": statistics.mean(tokens) if tokens else None,
        "completion_tokens_per_step": statistics.mean(completion_tokens) if completion_tokens else None,
        "tokens_per_s": (statistics.mean(tokens) / median) if tokens else None,
        "peak_rss_gib": max(r["peak_rss"] for r in runs) / 2**30,
        "train_peak_rss_gib": max(r["rss_train_peak"] for r in runs) / 2**30,
        "rss_at_train_start_gib": max(r["rss_train_start"] for r in runs) / 2**30,
        "first_step_s": statistics.median(r["ends"][0] - r["start"] for r in runs),
        "wall_s": statistics.median(r["wall"] for r in runs),
    }


def param_count(spec: Dict[str, Any]) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_tune_model(spec).parameters())


def flops_summary(params: int, side: Dict[str, Any], peak_tflops: Optional[float]) -> Dict[str, Any]:
    """Model FLOPs per step ~ 6 N (prompt + completion tokens, forward + backward) + 2 N (generated tokens)."""
    tokens, generated = side.get("tokens_per_step"), side.get("completion_tokens_per_step")
    if not tokens or not generated:
        return {}
    flops = 6 * params * tokens + 2 * params * generated
    out = {"model_tflops_per_step": flops / 1e12}
    if peak_tflops:
        out["mfu"] = flops / side["step_time_median_s"] / (peak_tflops * 1e12)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=CPU_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak, for MFU (H100 bf16: 989)")
    parser.add_argument("--rounds", type=int, default=2, help="A/B pairs per workload")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default per workload)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trl-python", default=sys.executable, help="a Python with trl installed")
    parser.add_argument("--ours-python", default=sys.executable)
    parser.add_argument("--workdir", default=None, help="where workloads are built (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument(
        "--ours-set", nargs="*", default=[], metavar="KEY=VALUE",
        help="config overrides for our recipe, as on tune run's command line (e.g. share_prompt_in_training=false)",
    )
    args = parser.parse_args(argv)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="grpo_bench_"))
    report: Dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "python": sys.version.split()[0],
            "loadavg_before": loadavg(),
        },
        "ours_overrides": list(args.ours_set),
        "workloads": {},
    }
    for name in args.workloads:
        spec = WORKLOADS[name]
        steps = args.steps or spec["steps"]
        wdir = build_workload(name, workdir / name)
        runs: Dict[str, List[Dict[str, Any]]] = {side: [] for side in args.sides}
        pythons = {"ours": args.ours_python, "trl": args.trl_python}
        for r in range(args.rounds):
            for side in args.sides:
                res = run_child(
                    pythons[side], side, wdir, steps, args.threads, args.device, args.dtype, args.ours_set
                )
                runs[side].append(res)
                times = [round(b - a, 3) for a, b in zip(res["ends"][:-1], res["ends"][1:])]
                print(f"[{name}] round {r + 1} {side}: step times {times} peak RSS "
                      f"{res['peak_rss'] / 2**30:.2f} GiB (load {loadavg()})", flush=True)
        entry: Dict[str, Any] = {"spec": spec, "steps_per_run": steps, "params": param_count(spec)}
        for side in args.sides:
            entry[side] = summarize(runs[side])
            entry[side].update(flops_summary(entry["params"], entry[side], args.peak_tflops))
        if "trl" in runs:
            entry["trl_version"] = runs["trl"][0].get("trl_version")
        if len(args.sides) == 2:
            ours, trl = entry["ours"], entry["trl"]
            entry.update(
                step_time_ratio=ours["step_time_median_s"] / trl["step_time_median_s"],
                step_cpu_time_ratio=ours["step_cpu_time_median_s"] / trl["step_cpu_time_median_s"],
                peak_rss_ratio=ours["peak_rss_gib"] / trl["peak_rss_gib"],
                train_peak_rss_ratio=ours["train_peak_rss_gib"] / trl["train_peak_rss_gib"],
            )
        report["workloads"][name] = entry
    report["machine"]["loadavg_after"] = loadavg()
    write_report(report, Path(args.json) if args.json else None, markdown_table(report))


def markdown_table(report: Dict[str, Any]) -> str:
    lines = [
        "| workload | side | step time (median) | CPU time/step | tokens/s | peak RSS | peak RSS while training |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, w in report["workloads"].items():
        for side in [x for x in ("ours", "trl") if x in w]:
            s = w[side]
            tps = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "n/a"
            lines.append(
                f"| {name} | {side} | {s['step_time_median_s']:.3f} s | {s['step_cpu_time_median_s']:.3f} s "
                f"| {tps} | {s['peak_rss_gib']:.2f} GiB "
                f"| {s['train_peak_rss_gib']:.2f} GiB |"
            )
        if "step_time_ratio" not in w:
            continue
        lines.append(
            f"| {name} | **ours / TRL** | **{w['step_time_ratio']:.2f}x** | **{w['step_cpu_time_ratio']:.2f}x** "
            f"| | **{w['peak_rss_ratio']:.2f}x** "
            f"| **{w['train_peak_rss_ratio']:.2f}x** |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_child_"):
        side, wdir, nsteps, out_path = sys.argv[1][len("_child_"):], Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
        if side == "ours":
            run_ours(wdir, nsteps, out_path, sys.argv[5], sys.argv[6], json.loads(sys.argv[7]))
        else:
            run_trl(wdir, nsteps, out_path, sys.argv[5], sys.argv[6])
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (gloo/TRL threads); the result file is written
    main()
