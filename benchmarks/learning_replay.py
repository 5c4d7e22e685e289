"""Many steps of identical rollouts through our update and TRL's (issue #18, items 2 and 3).

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
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import learning_parity_checks as parity
import learning_vs_trl as bench
from harness import recipe_module

EMBED = "model.embed_tokens.weight"


def build_recipe(model_dir: Path, out: Path, groups: int, group_size: int, steps: int, **overrides):
    """Our recipe on the benchmark's settings and seed-0 order, ``groups x group_size`` rows per step."""
    from omegaconf import OmegaConf

    cfg = bench.recipe_config(model_dir, out / "train_order.jsonl", out / "ours_out", seed=0, steps=steps)
    cfg.update(batch_size=groups, group_size=group_size, micro_batch_size=groups * group_size, **overrides)
    cfg = OmegaConf.create(cfg)
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    return recipe


def sample_batches(recipe, out: Path, steps: int, groups: int) -> List[Dict[str, Any]]:
    """``steps`` batches sampled and scored by our engine from the base model (plain lists, for TRL too)."""
    order = bench.read_jsonl(out / "train_order.jsonl")
    batches = []
    for k in range(steps):
        r = recipe.step.rollouts.round(recipe.model, recipe.prompts.next())
        batches.append({
            "prompts": [order[k * groups + i]["prompt"] for i in range(groups)],
            "answers": [f["answer"] for f in r.fields], "prompt_ids": [list(p) for p in r.prompt_ids],
            "response_ids": [list(x) for x in r.response_ids], "rewards": r.rewards.tolist(),
            "truncated": r.truncated.tolist(),
        })
    return batches


def replay_ours(recipe, batches: List[Dict[str, Any]], model_dir: Path, group_size: int) -> Dict[str, Any]:
    """Our recipe's step on each batch in turn: per-step metrics and the total parameter change (HF names)."""
    from torchtune_grpo.producer import FixedRollouts  # our venv only (the TRL side imports this file too)

    before = {k: v.detach().clone() for k, v in recipe.model.named_parameters()}
    steps = []
    for data in batches:
        recipe.step.rollouts = FixedRollouts(parity.rollouts_from(data, recipe.tokenizer, group_size))
        metrics = recipe.train_step().metrics
        steps.append({k: float(metrics[k]) for k in ("loss", "grad_norm", "entropy")})
    delta = {k: p.detach() - before[k] for k, p in recipe.model.named_parameters()}
    return {"steps": steps, "delta": parity.hf_named(model_dir, delta)}


def replay_trl(model_dir: Path, batches_path: Path, result_path: Path, group_size: int) -> None:
    """Child (TRL's environment): TRL's scoring, loss, clipping and AdamW on each saved batch in turn."""
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
    torch.save({"steps": steps, "delta": {k: p.detach() - before[k] for k, p in model.named_parameters()}},
               result_path)


def run_trl_child(python: str, model_dir: Path, out: Path, group_size: int) -> None:
    parity.run_in_trl_env(python, Path(__file__).resolve(), ["_trl", str(model_dir), str(out / "batches.pt"),
                                                         str(out / "trl_replay.pt"), str(group_size)])


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


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--model-dir", default=None,
                        help="SmolLM2 (built here if absent) or a trained Hugging Face checkpoint to start from")
    parser.add_argument("--out", default="replay")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=2, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    args = parser.parse_args(argv)

    import torch

    from smollm2 import prepare_smollm2

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir or out / "smollm2-135m").resolve()
    if not (model_dir / "config.json").is_file():  # a trained checkpoint (step_N) is used as it is
        model_dir = prepare_smollm2(model_dir)
    task_dir = out / "task"
    bench.build_task(model_dir, task_dir)
    bench.write_seed_order(task_dir, 0, out)
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
        replay_trl(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
        os._exit(0)
    main()
