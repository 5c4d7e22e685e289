"""Many steps of identical rollouts through our update and TRL's: does a difference compound over steps?

``learning_parity_checks.py`` compares one step. Here our engine samples ``--steps`` batches once (each
``--groups`` prompts x ``--group-size`` completions of the benchmark's task from the base model, scored by
the benchmark's reward), and the same batches then go, in order, through ``--steps`` updates of

- our recipe (its real ``train_step`` with the rollout stage replaced: advantages, loss, backward,
  clipping, AdamW), with the exact gradient (the default);
- our recipe with ``drop_pad_embedding_grad: true`` (TRL's padding_idx behaviour, see docs/algorithms.md);
- TRL's GRPOTrainer (its scoring, padding, loss, clipping and AdamW; its generation replaced), in TRL's
  environment (a subprocess over a saved ``.pt``).

Every side sees the same tokens and rewards, so whatever separates their logged entropies or their trained
weights comes from the update alone, compounded over the steps (Adam's moments included), and not from
sampling. Printed per step: loss, grad norm and the policy's entropy on that step's rollouts (before the
update); after the last step: each parameter's total change against TRL's (relative L2), with the tied
embedding split into the pad token's row (``<|im_end|>`` for SmolLM2) and the rest.

    python benchmarks/learning_replay.py --trl-python /work/bench-venv/bin/python --model-dir DIR --out /tmp/replay

``--model-dir`` may be a trained checkpoint (e.g. a ``step_15`` kept by ``learning_vs_trl.py
--keep-checkpoints``): the replay then starts where the policy's entropy is low, late in a run.

``--closed-loop`` (the late learning gap against TRL, docs/benchmarks/closed_loop.md) replays our *loop*
instead: our recipe runs ``--steps`` steps exactly as a
``learning_vs_trl.py --sides ours`` run of ``--seed`` (prompt order) and ``--recipe-seed`` (sampling stream)
does, each step sampling from the weights it has trained so far, and every step's rollouts are kept; TRL's
update then replays them in order from the base weights. Both sides' weights are evaluated held-out every
``--eval-every`` steps with the benchmark's evaluator (``closed_loop_report.txt``):

    python benchmarks/learning_replay.py --closed-loop --seed 2 --recipe-seed 1002 --steps 30 \
        --trl-python /work/bench-venv/bin/python --model-dir DIR --out /tmp/closed_loop

Our loop also checks, at every step, that the native engine samples the trainer's current policy: the
logprob of each drawn token under the distribution the engine drew it from against the trainer's forward
on the same tokens, before the update (a stale engine would pass the replay, which takes the samples as
given). ``--ours-only`` stops there (no TRL side, no evaluation); ``--reuse-ours`` runs TRL's side again
from a finished run of ours in ``--out``.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import learning_parity_checks as parity
import learning_vs_trl as bench
from harness import recipe_module

EMBED = "model.embed_tokens.weight"


def build_recipe(model_dir: Path, out: Path, groups: int, group_size: int, steps: int, seed: int = 0, **overrides):
    """Our recipe on the benchmark's settings, ``groups x group_size`` rows per step, reading the order in
    ``out/train_order.jsonl``; ``seed`` seeds its sampling stream."""
    from omegaconf import OmegaConf

    cfg = bench.recipe_config(model_dir, out / "train_order.jsonl", out / "ours_out", seed=seed, steps=steps)
    cfg.update(batch_size=groups, group_size=group_size, micro_batch_size=groups * group_size, **overrides)
    cfg = OmegaConf.create(cfg)
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    return recipe


def batch_record(r, order: List[Dict[str, Any]], k: int, groups: int) -> Dict[str, Any]:
    """Step ``k``'s rollouts ``r`` as plain lists (for TRL too), with the prompt texts of the order file."""
    return {
        "prompts": [order[(k * groups + i) % len(order)]["prompt"] for i in range(groups)],
        "answers": [f["answer"] for f in r.fields], "prompt_ids": [list(p) for p in r.prompt_ids],
        "response_ids": [list(x) for x in r.response_ids], "rewards": r.rewards.tolist(),
        "truncated": r.truncated.tolist(),
    }


def sample_batches(recipe, out: Path, steps: int, groups: int) -> List[Dict[str, Any]]:
    """``steps`` batches sampled and scored by our engine from the base model (plain lists, for TRL too)."""
    order = bench.read_jsonl(out / "train_order.jsonl")
    return [batch_record(recipe.step.rollouts.round(recipe.model, recipe.prompts.next()), order, k, groups)
            for k in range(steps)]


class RecordingRollouts:
    """Our loop's own rollout stage, unchanged, keeping a copy of what each step sampled and scored, and
    checking that the native engine sampled the policy being trained (not stale weights).

    Args:
        inner: the recipe's rollout producer (``recipe.step.rollouts``).
        order (List[Dict[str, Any]]): the order file's rows (prompt texts for TRL).
        groups (int): prompts per step.
        pad_id (int): the tokenizer's padding id.
        temperature (float): the engine's sampling temperature.
    """

    def __init__(self, inner: Any, order: List[Dict[str, Any]], groups: int, pad_id: int,
                 temperature: float) -> None:
        self.inner, self.order, self.groups, self.pad_id, self.temperature = inner, order, groups, pad_id, temperature
        self.batches: List[Dict[str, Any]] = []
        self.on_policy: List[float] = []  # per step: max |engine's sampled-token logprob - trainer's|

    def collect(self, policy: Any, batch: Any = None):
        with parity.recorded_engine_draws() as seen:
            generated, rounds = self.inner.collect(policy, batch)
        k = len(self.batches)
        if seen:  # the native engine: compare with the trainer's forward, same weights, before the update
            lp, _, misaligned, _ = parity.engine_vs_trainer(policy, generated.prompt_ids, generated.response_ids,
                                                           seen, self.pad_id, self.temperature)
            if misaligned:
                raise RuntimeError(f"step {k + 1}: {misaligned} rows' recorded draws are not their tokens")
            self.on_policy.append(max(lp) if lp else float("nan"))
        record = batch_record(generated, self.order, k, self.groups)
        if [self.order[(k * self.groups + i) % len(self.order)]["answer"] for i in range(self.groups)] != record["answers"]:
            raise RuntimeError(f"step {k + 1} sampled other prompts than the order file's next")
        self.batches.append(record)
        return generated, rounds


def closed_loop_ours(recipe, out: Path, steps: int, groups: int, eval_every: int) -> Dict[str, Any]:
    """Our recipe's own loop (its ``train_step``, sampling from the weights it trains) for ``steps`` steps,
    recording every step's rollouts; checkpoints at the evaluation steps, as ``learning_vs_trl.py`` runs it."""
    recorder = RecordingRollouts(recipe.step.rollouts, bench.read_jsonl(out / "train_order.jsonl"), groups,
                                 recipe.tokenizer.pad_id, recipe.engine.temperature)
    recipe.step.rollouts = recorder
    before = {k: v.detach().clone() for k, v in recipe.model.named_parameters()}
    recipe.optimizer.zero_grad(set_to_none=True)  # as recipe.train()
    steps_out, checkpoints = [], []
    for _ in range(steps):
        metrics = recipe.train_step().metrics
        steps_out.append({k: float(metrics[k]) for k in ("loss", "grad_norm", "entropy")}
                         | {"reward": float(metrics["reward/mean"])})
        if bench.due(recipe.global_step, steps, eval_every):
            recipe.save_checkpoint(recipe.global_step)
            checkpoints.append({"step": recipe.global_step, "path": str(out / "ours_out" / f"step_{recipe.global_step}")})
    delta = {k: p.detach() - before[k] for k, p in recipe.model.named_parameters()}
    return {"steps": steps_out, "batches": recorder.batches, "checkpoints": checkpoints, "delta": delta,
            "on_policy": recorder.on_policy}


def replay_ours(recipe, batches: List[Dict[str, Any]], model_dir: Path, group_size: int) -> Dict[str, Any]:
    """Our recipe's step on each batch in turn: per-step metrics and the total parameter change (HF names)."""
    from torchtune_grpo.rollouts.producer import FixedRollouts  # our venv only (the TRL side imports this file too)

    before = {k: v.detach().clone() for k, v in recipe.model.named_parameters()}
    steps = []
    for data in batches:
        recipe.step.rollouts = FixedRollouts(parity.rollouts_from(data, recipe.tokenizer, group_size))
        metrics = recipe.train_step().metrics
        steps.append({k: float(metrics[k]) for k in ("loss", "grad_norm", "entropy")})
    delta = {k: p.detach() - before[k] for k, p in recipe.model.named_parameters()}
    return {"steps": steps, "delta": parity.hf_named(model_dir, delta)}


def replay_trl(model_dir: Path, batches_path: Path, result_path: Path, group_size: int, save_every: int = 0) -> None:
    """Child (TRL's environment): TRL's scoring, loss, clipping and AdamW on each saved batch in turn; with
    ``save_every``, TRL's weights as a Hugging Face directory ``trl_step_N`` beside ``result_path`` every
    ``save_every`` steps and after the last."""
    import torch

    batches = torch.load(batches_path)
    s = bench.SETTINGS
    rows = [{"prompt": p, "answer": a} for b in batches for p, a in zip(b["prompts"], b["answers"])]
    held: Dict[str, Any] = {"prompt_ids": batches[0]["prompt_ids"][::group_size], "response_ids": [], "rewards": []}
    trainer, model = parity.trl_trainer(model_dir, rows, group_size, held, result_path.parent)
    trainer.current_gradient_accumulation_steps = 1
    trainer.create_optimizer()
    model.train()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    steps = []
    for b in batches:
        held.update(prompt_ids=b["prompt_ids"][::group_size], response_ids=b["response_ids"], rewards=b["rewards"])
        batch = [{"prompt": p, "answer": a} for p, a in zip(b["prompts"], b["answers"]) for _ in range(group_size)]
        inputs = trainer._generate_and_score_completions(batch)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_grad_norm"])
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        steps.append({"loss": float(loss.detach()), "grad_norm": float(norm),
                      "entropy": float(trainer._metrics["train"]["entropy"][-1])})
        if save_every and bench.due(len(steps), len(batches), save_every):
            model.save_pretrained(str(result_path.parent / f"trl_step_{len(steps)}"))
    torch.save({"steps": steps, "delta": {k: p.detach() - before[k] for k, p in model.named_parameters()}},
               result_path)


def run_trl_child(python: str, model_dir: Path, out: Path, group_size: int, save_every: int = 0) -> None:
    parity.run_in_trl_env(python, Path(__file__).resolve(), ["_trl", str(model_dir), str(out / "batches.pt"),
                                                         str(out / "trl_replay.pt"), str(group_size), str(save_every)])


def compare(name: str, ours: Dict[str, Any], trl: Dict[str, Any], pad_id: int) -> List[str]:
    """Per-step metric differences and the total parameter change of ``ours`` against TRL's."""
    import torch

    lines = []
    for key in ("loss", "grad_norm", "entropy"):
        a = [s[key] for s in ours["steps"]]
        b = [s[key] for s in trl["steps"]]
        worst = max(range(len(a)), key=lambda i: abs(a[i] - b[i]))
        lines.append(f"{name}: {key} per step, max |ours - TRL| {abs(a[worst] - b[worst]):.2e} at step {worst + 1} "
                     f"({a[worst]:.5f} vs {b[worst]:.5f}); last step {a[-1]:.5f} vs {b[-1]:.5f}")
    errs = {k: parity.rel(ours["delta"][k], trl["delta"][k]) for k in trl["delta"] if k != EMBED}
    emb_a, emb_b = ours["delta"][EMBED], trl["delta"][EMBED]
    keep = torch.ones(emb_a.size(0), dtype=torch.bool)
    keep[pad_id] = False
    worst = max(errs, key=errs.get)
    lines.append(
        f"{name}: total parameter change vs TRL, relative L2: {len(errs)} non-embedding tensors median "
        f"{sorted(errs.values())[len(errs) // 2]:.2e}, worst {errs[worst]:.2e} ({worst}); embedding without row "
        f"{pad_id} {parity.rel(emb_a[keep], emb_b[keep]):.2e}; row {pad_id} {parity.rel(emb_a[pad_id], emb_b[pad_id]):.2e} "
        f"(norms: ours {float(emb_a[pad_id].norm()):.3e}, TRL {float(emb_b[pad_id].norm()):.3e})")
    return lines


def closed_loop(args: argparse.Namespace, model_dir: Path, out: Path, task_dir: Path) -> None:
    """``--closed-loop``: our loop's rollouts, sampled by the policy it trains, through TRL's update.

    Our recipe runs exactly as a ``learning_vs_trl.py --sides ours`` run of the same seeds (same settings,
    order and sampling stream; with the same thread count it reproduces that run's per-step rewards), and
    every step's rollouts are kept. TRL's update then replays them in order from the base weights. If the
    two updates differ anywhere in the states our loop reaches (trained, low-entropy, all-equal groups),
    the two weight trajectories part and their held-out accuracies differ; if not, TRL's update given our
    loop's samples learns what our loop learns.
    """
    import torch

    from torchtune_grpo.models import hf_tokenizer

    t0 = time.perf_counter()
    recipe_seed = args.seed if args.recipe_seed is None else args.recipe_seed
    saved = out / "ours_loop.pt"
    if args.reuse_ours and saved.is_file():  # our loop ran already (e.g. TRL's side was killed): TRL's side only
        ours = torch.load(saved)
    else:
        recipe = build_recipe(model_dir, out, args.groups, args.group_size, args.steps, seed=recipe_seed)
        ours = closed_loop_ours(recipe, out, args.steps, args.groups, args.eval_every)
        recipe.cleanup()
        del recipe  # TRL's side needs the memory
        ours["delta"] = parity.hf_named(model_dir, ours["delta"])
        torch.save(ours["batches"], out / "batches.pt")
        torch.save(ours, saved)
    tokenizer = hf_tokenizer(str(model_dir))
    t_ours = time.perf_counter() - t0
    on_policy = ours.get("on_policy") or []
    on_policy_line = ("on-policy in the loop (native engine): max |sampled-token logprob, engine - trainer| per step "
                      + " ".join(f"{x:.1e}" for x in on_policy) + f"; worst {max(on_policy):.1e}") if on_policy else ""
    if args.ours_only:
        print(on_policy_line)
        (out / "closed_loop_report.txt").write_text(on_policy_line + "\n")
        return
    run_trl_child(args.trl_python, model_dir, out, args.group_size, save_every=args.eval_every)
    trl = torch.load(out / "trl_replay.pt")
    report = [f"closed loop: order seed {args.seed}, our sampling seed {recipe_seed}, {args.steps} steps of "
              f"{args.groups} x {args.group_size}; ours {t_ours:.0f} s"]
    report.append("per-step reward of our loop: " + " ".join(f"{s['reward']:.4f}" for s in ours["steps"]))
    if on_policy_line:
        report.append(on_policy_line)
    report += compare("TRL's update on our loop's rollouts", ours, trl, tokenizer.pad_id)
    report.append("per step grad norm (ours / TRL): " + "; ".join(
        f"{i + 1}: {a['grad_norm']:.4f} / {b['grad_norm']:.4f}" for i, (a, b) in enumerate(zip(ours["steps"], trl["steps"]))))

    from transformers import AutoModelForCausalLM

    rows = bench.read_jsonl(task_dir / "heldout.jsonl")
    table = ["| step | ours (its own loop) | TRL's update on the same rollouts |", "|---|---|---|"]
    for ck in ours["checkpoints"]:
        accs = []
        for path in (ck["path"], str(out / f"trl_step_{ck['step']}")):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            accs.append(bench.greedy_accuracy(model, tokenizer, rows, bench.SETTINGS["max_new_tokens"], tokenizer.eos_id))
            del model
            shutil.rmtree(path, ignore_errors=True)  # 1.6 GB each with our optimizer state
        table.append(f"| {ck['step']} | {accs[0]['accuracy']:.3f} (length {accs[0]['mean_length']:.1f}) | "
                     f"{accs[1]['accuracy']:.3f} (length {accs[1]['mean_length']:.1f}) |")
    report += ["held-out greedy accuracy:"] + table + [f"took {time.perf_counter() - t0:.0f} s"]
    text = "\n".join(report)
    print(text)
    (out / "closed_loop_report.txt").write_text(text + "\n")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--model-dir", default=None,
                        help="SmolLM2 (built here if absent) or a trained Hugging Face checkpoint to start from")
    parser.add_argument("--out", default="replay")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=None, help="prompts per step (default 2; closed loop: 4)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="completions per prompt (default 4; closed loop: 8)")
    parser.add_argument("--closed-loop", action="store_true",
                        help="our recipe's own loop samples each step from the weights it trains (the benchmark "
                             "run itself), and TRL's update replays those rollouts; both evaluated held-out")
    parser.add_argument("--seed", type=int, default=0, help="prompt order (learning_vs_trl.py's seed)")
    parser.add_argument("--recipe-seed", type=int, default=None, help="our sampling stream (default: --seed)")
    parser.add_argument("--eval-every", type=int, default=5, help="closed loop: checkpoints evaluated held-out")
    parser.add_argument("--ours-only", action="store_true",
                        help="closed loop: our loop only, with its on-policy check (no TRL side, no evaluation)")
    parser.add_argument("--reuse-ours", action="store_true",
                        help="closed loop: take our loop's run from --out (ours_loop.pt) and run TRL's side only")
    args = parser.parse_args(argv)
    default_shape = (bench.SETTINGS["batch_size"], bench.SETTINGS["group_size"]) if args.closed_loop else (2, 4)
    args.groups, args.group_size = args.groups or default_shape[0], args.group_size or default_shape[1]

    import torch

    from smollm2 import prepare_smollm2

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir or out / "smollm2-135m").resolve()
    if not (model_dir / "config.json").is_file():  # a trained checkpoint (step_N) is used as it is
        model_dir = prepare_smollm2(model_dir)
    task_dir = out / "task"
    bench.build_task(model_dir, task_dir)
    bench.write_seed_order(task_dir, args.seed, out)
    if args.closed_loop:
        closed_loop(args, model_dir, out, task_dir)
        return
    t0 = time.perf_counter()
    shape = dict(groups=args.groups, group_size=args.group_size, steps=args.steps)
    recipe = build_recipe(model_dir, out, **shape)
    batches = sample_batches(recipe, out, args.steps, args.groups)
    torch.save(batches, out / "batches.pt")
    rewards = torch.tensor([b["rewards"] for b in batches]).view(args.steps, args.groups, args.group_size)
    informative = int((rewards.std(-1) > 0).sum())
    report = [f"{args.steps} batches of {args.groups} x {args.group_size} sampled in {time.perf_counter() - t0:.0f} s; "
              f"mean reward {float(rewards.mean()):.3f}; informative groups {informative} of "
              f"{args.steps * args.groups}; mean length {sum(len(r) for b in batches for r in b['response_ids']) / rewards.numel():.1f}"]
    pad_id = recipe.tokenizer.pad_id
    exact = replay_ours(recipe, batches, model_dir, args.group_size)  # the sampling left the weights as they were
    recipe.cleanup()
    recipe = build_recipe(model_dir, out, **shape, drop_pad_embedding_grad=True)
    dropped = replay_ours(recipe, batches, model_dir, args.group_size)
    recipe.cleanup()
    run_trl_child(args.trl_python, model_dir, out, args.group_size)
    trl = torch.load(out / "trl_replay.pt")
    report += compare("ours (exact gradient)", exact, trl, pad_id)
    report += compare("ours (drop_pad_embedding_grad)", dropped, trl, pad_id)
    report.append("per step entropy: " + "; ".join(
        f"{i + 1}: {a['entropy']:.4f} / {b['entropy']:.4f} / {c['entropy']:.4f}"
        for i, (a, b, c) in enumerate(zip(exact["steps"], dropped["steps"], trl["steps"])))
        + " (ours exact / ours drop_pad_embedding_grad / TRL)")
    report.append(f"took {time.perf_counter() - t0:.0f} s")
    text = "\n".join(report)
    print(text)
    (out / "replay_report.txt").write_text(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_trl":
        replay_trl(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        os._exit(0)
    main()
