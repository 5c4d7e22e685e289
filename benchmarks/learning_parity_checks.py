"""Our GRPO update vs TRL's on identical inputs, and our sampler vs exact sampling (docs/benchmarks/learning_parity.md).

Load-independent checks on SmolLM2-135M-Instruct (tied embeddings), each printed with a verdict and numbers:

1. **Same rollouts, both updates.** Our recipe samples 2 prompts x 4 completions (48 tokens) of the
   benchmark's task with its own engine; the rewards are then fixed to a pattern that makes both groups
   informative. These rows (prompt ids, completion ids up to and including ``<|im_end|>``, rewards) go
   (a) through our recipe's real step (``train_step`` with the rollout stage replaced by these rows:
   packing, masks, advantages, loss, backward, clipping, AdamW) and (b) through TRL's
   ``GRPOTrainer._generate_and_score_completions`` (its generation replaced by the same rows: TRL's own
   padding, EOS mask, advantages) and ``compute_loss``, backward, clipping and AdamW, in TRL's environment
   (a subprocess over a saved ``.pt``). Compared: which tokens get loss (per row), per-token logprobs and
   entropies, advantages, the logged entropy, loss, grad norm, every parameter's gradient (Hugging Face
   names; the tied embedding once), the parameter change after one AdamW step and Adam's second moment.
2. **Sampling.** Our native engine samples ``--samples`` completions of 3 tokens from one prompt at
   temperature 1; the empirical distribution of the first token, of the second given the most common first,
   and of the third given the most common first two is compared with the model's exact softmax at those
   positions (a full forward of the prefix): total-variation distance and a chi-square test over the
   tokens expected >= 5 times (the rest pooled). ``torch.multinomial`` with the same number of draws from
   the exact distribution is the control (its TV is what sampling noise alone gives).
3. **Defaults**: temperature/top-k/top-p of our engine and of TRL's config and generation config.
4. **Whole sequences** (``--checks sequences``, not in the default set): completions of 4 train prompts,
   ``--sequences`` per prompt, from our engine and from transformers' ``generate`` (TRL's sampler) with the
   same weights: mean length, fraction stopped and the base model's mean entropy over the sampled positions,
   with permutation p-values; a third side, the referee, samples exactly in the plainest way (transformers'
   model forward, ``torch.multinomial`` over the float64 softmax, none of ``generate``'s processing).
   Where check 2 looks at three positions, this covers all 48.
5. **The engine's own distributions** (``--checks engine_logprobs``, not in the default set): every
   distribution the native engine samples from (its KV-cached decode) against the trainer's teacher-forced
   forward of the finished sequences, sampled-token logprobs and entropies; with ``--model-dir`` a trained
   checkpoint, this is the check of a sampler that drifts from the trainer as the policy sharpens.

    python benchmarks/learning_parity_checks.py --trl-python /work/bench-venv/bin/python --out /tmp/parity
"""

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import learning_vs_trl as bench
from harness import recipe_module, run_child

GROUPS, G = 2, 4
FIXED_REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]  # both groups informative, different advantages


def verdict(ok: bool) -> str:
    return "OK  " if ok else "DIFF"


# ------------------------------------------------------------------------------------ our side (parent)


def build_recipe(model_dir: Path, task_dir: Path, out: Path):
    from omegaconf import OmegaConf

    out.mkdir(parents=True, exist_ok=True)
    bench.write_seed_order(task_dir, 0, out)
    cfg = bench.recipe_config(model_dir, out / "train_order.jsonl", out / "ours_out", seed=0, steps=1)
    cfg.update(batch_size=GROUPS, group_size=G, micro_batch_size=GROUPS * G)
    cfg = OmegaConf.create(cfg)
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    return recipe


def hf_named(model_dir: Path, tensors: Dict[str, Any]) -> Dict[str, Any]:
    """torchtune parameter name -> Hugging Face name (q/k rows permuted back), for our model."""
    from torchtune_grpo.models import HFModelSpec, tune_to_hf_param

    spec = HFModelSpec.from_directory(model_dir)
    return dict(tune_to_hf_param(k, v, rope_order=spec.rope_order, head_dim=spec.head_dim) for k, v in tensors.items())


def run_ours(recipe, rollouts, model_dir: Path) -> Dict[str, Any]:
    """Our recipe's real step on ``rollouts``; returns grads, deltas, Adam state, masks, logprobs, metrics."""
    import torch

    from torchtune_grpo.training.batch import batch_token_logprobs

    model, opt = recipe.model, recipe.optimizer
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    captured: Dict[str, Any] = {}

    # torch's optimizer hooks: the (clipped) gradients just before the step, the change and Adam's state after.
    def grads_before_step(optimizer, args, kwargs):
        captured["grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    def delta_after_step(optimizer, args, kwargs):
        captured["delta"] = {k: p.detach() - before[k] for k, p in model.named_parameters()}
        captured["exp_avg_sq"] = {k: opt.state[p]["exp_avg_sq"].clone() for k, p in model.named_parameters()}

    hooks = [opt.register_step_pre_hook(grads_before_step), opt.register_step_post_hook(delta_after_step)]
    inner_experience = recipe.step.build_experience

    def experience_and_capture(policy, trained):
        exp, kl = inner_experience(policy, trained)
        with torch.no_grad():
            lp = batch_token_logprobs(model, exp.batch, micro_batch_size=len(exp), with_entropy=True)
        mask = exp.mask.bool()
        captured["mask_counts"] = mask.sum(-1).tolist()
        captured["logprobs"] = [lp.logprobs[i][mask[i]].tolist() for i in range(len(exp))]
        captured["entropies"] = [lp.entropy[i][mask[i]].tolist() for i in range(len(exp))]
        captured["advantages"] = exp.advantages.tolist()
        return exp, kl

    from torchtune_grpo.rollouts.producer import FixedRollouts  # our venv only (the TRL side imports this file too)

    # The step's stages are public parts (torchtune_grpo/training/step.py): this one replays fixed rollouts and
    # records what the experience stage built.
    recipe.step.rollouts = FixedRollouts(rollouts)
    recipe.step.build_experience = experience_and_capture
    metrics = recipe.train_step().metrics
    recipe.step.build_experience = inner_experience
    for hook in hooks:
        hook.remove()
    clip = float(recipe.config.clip_grad_norm)
    norm = float(metrics["grad_norm"])
    scale = max(norm / clip, 1.0)  # undo the clipping: raw gradients, comparable whatever the norms
    return {
        "grads": {k: v * scale for k, v in hf_named(model_dir, captured["grads"]).items()},
        "delta": hf_named(model_dir, captured["delta"]),
        "exp_avg_sq": hf_named(model_dir, captured["exp_avg_sq"]),
        "mask_counts": captured["mask_counts"], "logprobs": captured["logprobs"],
        "entropies": captured["entropies"], "advantages": captured["advantages"],
        "entropy": float(metrics["entropy"]), "loss": float(metrics["loss"]), "grad_norm": norm,
    }


# ------------------------------------------------------------------------------------------- TRL child


def trl_trainer(model_dir: Path, rows: List[Dict[str, Any]], group_size: int, held: Dict[str, Any], out_dir: Path):
    """TRL's GRPOTrainer with the benchmark's settings, sampling and scoring nothing itself.

    Its generation returns ``held["response_ids"]`` (after checking that TRL tokenised each prompt to
    ``held["prompt_ids"]``) and its reward function ``held["rewards"]``: set them before each step.
    """
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = bench.SETTINGS
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def fixed_reward(prompts, completions, completion_ids, **kwargs):
        return list(held["rewards"])[: len(completions)]

    rows_per_step = len(held["prompt_ids"]) * group_size
    args = trl.GRPOConfig(
        output_dir=str(out_dir / "trl_out"), per_device_train_batch_size=rows_per_step,
        gradient_accumulation_steps=1, num_generations=group_size, max_completion_length=s["max_new_tokens"],
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=s["clip_grad_norm"], optim="adamw_torch", beta=0.0, epsilon=s["epsilon"], loss_type="dapo",
        scale_rewards="group", num_iterations=1, temperature=1.0, top_p=1.0, top_k=0, max_steps=1,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, shuffle_dataset=False, seed=0, log_completions=False, disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[fixed_reward], args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer)

    def fixed_generation(prompt_ids, images, multimodal_fields, num_generations, *a, **kw):
        for got, want in zip(prompt_ids, [p for p in held["prompt_ids"] for _ in range(group_size)]):
            if list(got) != list(want):
                raise RuntimeError(f"TRL tokenised a prompt differently: {list(got)[:12]}... vs {list(want)[:12]}...")
        return [list(c) for c in held["response_ids"][: len(prompt_ids)]], None

    trainer._generate_single_turn = fixed_generation
    return trainer, model


def run_trl(model_dir: Path, rollouts_path: Path, result_path: Path) -> None:
    """Child (TRL's environment): TRL's scoring, loss, clipping and AdamW step on the saved rollouts."""
    import dataclasses

    import torch
    import trl

    data = torch.load(rollouts_path)
    s = bench.SETTINGS
    rows = [{"prompt": p, "answer": a} for p, a in zip(data["prompts"], data["answers"])]
    held = {"prompt_ids": data["prompt_ids"][::G], "response_ids": data["response_ids"], "rewards": data["rewards"]}
    trainer, model = trl_trainer(model_dir, rows, G, held, result_path.parent)
    trainer.current_gradient_accumulation_steps = 1
    model.train()
    batch = [row for row in rows for _ in range(G)]  # TRL's RepeatSampler: each prompt G times in a row
    inputs = trainer._generate_and_score_completions(batch)
    mask = inputs["completion_mask"].bool()
    with torch.no_grad():
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, ents, _ = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention, inputs["completion_ids"].size(1), compute_entropy=True)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    raw = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_grad_norm"])
    trainer.create_optimizer()
    trainer.optimizer.step()
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)
    names = {id(p): k for k, p in model.named_parameters()}
    config_defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)
                       if f.name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "loss_type",
                                     "scale_rewards", "mask_truncated_completions", "beta", "epsilon")}
    gc = trainer.generation_config
    torch.save({
        "grads": raw,
        "delta": {k: p.detach() - before[k] for k, p in model.named_parameters()},
        "exp_avg_sq": {names[id(p)]: st["exp_avg_sq"].clone() for p, st in opt.state.items()},
        "mask_counts": mask.sum(-1).tolist(),
        "logprobs": [logps[i][mask[i]].tolist() for i in range(mask.size(0))],
        "entropies": [ents[i][mask[i]].tolist() for i in range(mask.size(0))],
        "advantages": inputs["advantages"].tolist(),
        "entropy": float(trainer._metrics["train"]["entropy"][-1]),
        "loss": float(loss.detach()), "grad_norm": float(norm),
        "adam": {**{k: v for k, v in opt.defaults.items() if k in ("lr", "betas", "eps", "amsgrad")},
                 "weight_decay (per param group)": sorted({g["weight_decay"] for g in opt.param_groups})},
        "config_defaults": config_defaults,
        "generation_config": {k: getattr(gc, k, None) for k in ("do_sample", "temperature", "top_k", "top_p", "min_p",
                                                                 "repetition_penalty", "eos_token_id", "pad_token_id")},
        "trl_version": trl.__version__,
    }, result_path)


# ------------------------------------------------------------------------------------------- compare


def rel(a, b) -> float:
    import torch

    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def compare_update(ours: Dict[str, Any], trl: Dict[str, Any], tol: float) -> List[str]:
    """Per-check lines comparing the two updates."""
    import torch

    lines = []
    same_mask = ours["mask_counts"] == trl["mask_counts"]
    lines.append(f"{verdict(same_mask)} tokens with loss per row: ours {ours['mask_counts']} TRL {trl['mask_counts']}")
    diffs = [max((abs(x - y) for x, y in zip(a, b)), default=0.0) for a, b in zip(ours["logprobs"], trl["logprobs"])]
    lp = max(diffs) if same_mask else float("nan")
    lines.append(f"{verdict(lp < 1e-3)} per-token logprobs, max |ours - TRL| = {lp:.2e}")
    diffs = [max((abs(x - y) for x, y in zip(a, b)), default=0.0) for a, b in zip(ours["entropies"], trl["entropies"])]
    ent = max(diffs) if same_mask else float("nan")
    lines.append(f"{verdict(ent < 1e-3)} per-token entropies, max |ours - TRL| = {ent:.2e}")
    adv = max(abs(x - y) for x, y in zip(ours["advantages"], trl["advantages"]))
    lines.append(f"{verdict(adv < 1e-3)} advantages, max |ours - TRL| = {adv:.2e} (ours {[round(x, 4) for x in ours['advantages']]})")
    d = abs(ours["entropy"] - trl["entropy"])
    lines.append(f"{verdict(d < 1e-3)} logged entropy: ours {ours['entropy']:.5f} TRL {trl['entropy']:.5f}")
    d = abs(ours["loss"] - trl["loss"])
    lines.append(f"{verdict(d < 1e-4)} loss: ours {ours['loss']:.6f} TRL {trl['loss']:.6f}")
    d = abs(ours["grad_norm"] - trl["grad_norm"]) / trl["grad_norm"]
    lines.append(f"{verdict(d < tol)} grad norm (before clipping): ours {ours['grad_norm']:.6f} TRL {trl['grad_norm']:.6f}")
    for key, what in (("grads", "gradient"), ("delta", "parameter change after one AdamW step"),
                      ("exp_avg_sq", "Adam second moment")):
        a, b = ours[key], trl[key]
        missing = sorted(set(a) ^ set(b))
        errs = {k: rel(a[k], b[k]) for k in sorted(set(a) & set(b))}
        worst = max(errs, key=errs.get)
        emb = errs.get("model.embed_tokens.weight", float("nan"))
        ok = not missing and errs[worst] < tol
        lines.append(f"{verdict(ok)} {what}: {len(errs)} tensors, worst relative L2 error {errs[worst]:.2e} ({worst}); "
                     f"tied embedding {emb:.2e}; median {sorted(errs.values())[len(errs) // 2]:.2e}"
                     + (f"; names on one side only: {missing[:4]}" if missing else ""))
    a = torch.cat([ours["grads"][k].double().flatten() for k in sorted(trl["grads"])])
    b = torch.cat([trl["grads"][k].double().flatten() for k in sorted(trl["grads"])])
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()))
    lines.append(f"{verdict(cos > 1 - tol)} cosine of the full gradients: {cos:.8f}")
    return lines



def rollouts_from(data: Dict[str, Any], tokenizer, group_size: int = G):
    """The saved rollouts as our ``RolloutGroups``."""
    import torch

    from torchtune_grpo.generation import decode_responses
    from torchtune_grpo.rollouts.groups import RolloutGroups

    return RolloutGroups(
        group_size=group_size, prompts=list(data["prompts"]), fields=[{"answer": a} for a in data["answers"]],
        prompt_ids=[list(p) for p in data["prompt_ids"]], response_ids=[list(r) for r in data["response_ids"]],
        completions=decode_responses(tokenizer, data["response_ids"]), truncated=torch.tensor(data["truncated"]),
        rewards=torch.tensor(data["rewards"], dtype=torch.float32),
    )


def run_in_trl_env(python: str, script: Path, args: List[str]) -> None:
    """``python script args...`` (TRL's environment) with this repository importable (benchmarks/harness.py)."""
    run_child(python, script, args, threads=None)


def run_trl_child(python: str, model_dir: Path, out: Path) -> None:
    run_in_trl_env(python, Path(__file__).resolve(), ["_trl", str(model_dir), str(out / "rollouts.pt"), str(out / "trl_result.pt")])


def reference_update(model_dir: Path, data: Dict[str, Any], advantages: List[float]) -> Dict[str, Any]:
    """The exact on-policy GRPO gradient and per-token entropies in float64, one unpadded row at a time.

    At ratio 1 the clipped objective's gradient is ``-(1/M) sum_i A_i sum_t grad log pi(o_i,t)`` (M: all
    completion tokens, stop token included); transformers' model in float64 gives it without padding,
    packing or chunking, a referee for the two implementations (with the embedding's ``padding_idx`` off:
    the exact gradient, see docs/algorithms.md).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    # transformers' embedding drops the gradient of the pad token's row where it is an input (padding_idx);
    # SmolLM2's pad token is <|im_end|>, a real token of every prompt. The referee takes the exact gradient.
    model.get_input_embeddings().padding_idx = None
    total = sum(len(r) for r in data["response_ids"])
    entropies = []
    for prompt, resp, adv in zip([p for p in data["prompt_ids"]], data["response_ids"], advantages):
        ids = torch.tensor([list(prompt) + list(resp)])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [C, V]: position t predicts completion token t
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, torch.tensor(resp).unsqueeze(-1)).squeeze(-1)  # [C]
        (-(adv / total) * chosen.sum()).backward()
        entropies.append((-(logp.exp() * logp).sum(-1)).tolist())
    grads = {k: p.grad.float() for k, p in model.named_parameters()}
    flat = [e for row in entropies for e in row]
    return {"grads": grads, "entropies": entropies, "entropy": sum(flat) / len(flat)}


def compare_reference(ours: Dict[str, Any], trl: Dict[str, Any], ref: Dict[str, Any]) -> List[str]:
    """Both sides against the float64 referee: entropies and gradients (the tied embedding apart)."""
    import torch

    lines = []
    for name, side in (("ours", ours), ("TRL", trl)):
        ent = max(abs(x - y) for a, b in zip(side["entropies"], ref["entropies"]) for x, y in zip(a, b))
        errs = {k: rel(side["grads"][k], ref["grads"][k]) for k in ref["grads"]}
        worst = max(errs, key=errs.get)
        flat = torch.cat([side["grads"][k].double().flatten() for k in sorted(ref["grads"])])
        flat_ref = torch.cat([ref["grads"][k].double().flatten() for k in sorted(ref["grads"])])
        cos = float(torch.dot(flat, flat_ref) / (flat.norm() * flat_ref.norm()))
        lines.append(
            f"{verdict(ent < 1e-3)} {name} vs float64 reference: per-token entropy max error {ent:.2e} "
            f"(mean entropy {side['entropy']:.5f} vs {ref['entropy']:.5f})")
        lines.append(
            f"{verdict(errs[worst] < 1e-3)} {name} vs float64 reference: gradient worst relative error "
            f"{errs[worst]:.2e} ({worst}), tied embedding {errs['model.embed_tokens.weight']:.2e}, median "
            f"{sorted(errs.values())[len(errs) // 2]:.2e}, cosine {cos:.8f}")
    emb = {n: s["grads"]["model.embed_tokens.weight"] - ref["grads"]["model.embed_tokens.weight"] for n, s in
           (("ours", ours), ("TRL", trl))}
    for name, d in emb.items():
        rows = d.norm(dim=-1)
        top = torch.topk(rows, 5)
        lines.append(f"     {name}: embedding rows with the largest error {top.indices.tolist()} "
                     f"(norms {[f'{v:.2e}' for v in top.values.tolist()]}; reference row norms "
                     f"{[f'{v:.2e}' for v in ref['grads']['model.embed_tokens.weight'][top.indices].norm(dim=-1).tolist()]})")
    return lines


# ------------------------------------------------------------------------------------------- sampling


def sampling_check(recipe, prompt: List[int], samples: int, seed: int) -> List[str]:
    """Our engine's first three tokens vs exact softmax sampling (TV, chi-square), multinomial as control."""
    import torch

    def chisquare_p(obs: torch.Tensor, exp: torch.Tensor) -> float:
        """Pearson's chi-square p-value, ``len(obs) - 1`` degrees of freedom (upper regularised gamma)."""
        exp = exp * (obs.sum() / exp.sum())
        stat = ((obs - exp) ** 2 / exp).sum()
        dof = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
        return float(torch.special.gammaincc(dof / 2, stat / 2))

    model, tok = recipe.model, recipe.tokenizer
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    with recipe.generation_context():
        rollout = recipe.engine.generate(model, [prompt], group_size=samples, max_new_tokens=3, pad_id=tok.pad_id,
                                          stop_tokens=[], generator=gen)
    seconds = time.perf_counter() - t0
    ids = torch.tensor([r[:3] for r in rollout.response_ids])  # [S, 3]
    lines = [f"     ({samples} samples of 3 tokens in {seconds:.0f} s)"]
    prefix: List[int] = []
    rows = torch.ones(samples, dtype=torch.bool)
    for pos in range(3):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix]))[0, -1].float()
        p = torch.softmax(logits, dim=-1)  # exact distribution at this position
        got = ids[rows, pos]
        n = int(got.numel())
        counts = torch.bincount(got, minlength=p.numel()).double()
        control = torch.bincount(torch.multinomial(p, n, replacement=True, generator=gen), minlength=p.numel()).double()
        tv = 0.5 * float((counts / n - p.double()).abs().sum())
        tv_control = 0.5 * float((control / n - p.double()).abs().sum())
        expected = p.double() * n
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
        exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
        obs_c = torch.cat([control[big], control[~big].sum().unsqueeze(0)])
        pval, pval_c = chisquare_p(obs, exp), chisquare_p(obs_c, exp)
        top = int(p.argmax())
        ok = pval > 1e-3 and tv < 2 * tv_control + 0.02
        lines.append(
            f"{verdict(ok)} token {pos + 1} (after {len(prefix)} sampled tokens, {n} draws): TV {tv:.4f} "
            f"(multinomial control {tv_control:.4f}); chi-square p = {pval:.3g} over {int(big.sum())} bins + rest "
            f"(control p = {pval_c:.3g}); top token {top} exact {float(p[top]):.4f} sampled {float(counts[top] / n):.4f}"
        )
        mode = int(torch.mode(got).values)  # condition the next position on the most common token here
        rows = rows & (ids[:, pos] == mode)
        prefix = prefix + [mode]
    return lines


def sequence_check(recipe, model_dir: Path, prompts: List[List[int]], samples: int, seed: int) -> List[str]:
    """Whole completions: our engine vs transformers' ``generate`` (TRL's sampler), from the same weights.

    Each side draws ``samples`` completions of every prompt (temperature 1, no top-k/top-p, 48 tokens, stop at
    the tokenizer's stop tokens). Per completion: its length (stop token included), whether it stopped, and
    the base model's mean entropy over its positions (one teacher-forced forward, the same code for both
    sides). Differences of the means get a two-sided permutation p (2,000 random relabellings of the pooled
    completions); a sampler that departs from exact sampling anywhere in the sequence moves them.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tok = recipe.tokenizer
    stops = list(tok.stop_tokens)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = [], []
    model = recipe.model
    model.eval()
    t0 = time.perf_counter()
    for prompt in prompts:
        with recipe.generation_context():
            rollout = recipe.engine.generate(model, [prompt], group_size=samples, max_new_tokens=48,
                                              pad_id=tok.pad_id, stop_tokens=stops, generator=gen)
        ours += [(prompt, list(r)) for r in rollout.response_ids]
    t_ours = time.perf_counter() - t0
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=48,
                              num_return_sequences=samples, eos_token_id=stops, pad_token_id=tok.pad_id)
        for row in out[:, len(prompt):].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), None)
            theirs.append((prompt, row[: end + 1] if end is not None else row))
    t_hf = time.perf_counter() - t0
    # The referee: exact sampling in the plainest form. transformers' model forward (with its KV cache) gives
    # the last position's logits, and torch.multinomial draws from their float64 softmax: none of
    # generate()'s processing, none of our engine's code.
    exact = []
    t0 = time.perf_counter()
    stop_ids = torch.tensor(stops)
    for prompt in prompts:
        done = torch.zeros(samples, dtype=torch.bool)
        resp = [[] for _ in range(samples)]
        feed, past = torch.tensor([prompt] * samples), None
        for _ in range(48):
            with torch.no_grad():
                out = hf(feed, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            token = torch.multinomial(torch.softmax(out.logits[:, -1].double(), dim=-1), 1, generator=gen).squeeze(1)
            for i in range(samples):
                if not done[i]:
                    resp[i].append(int(token[i]))
            done |= torch.isin(token, stop_ids)
            if bool(done.all()):
                break
            feed = token.view(-1, 1)
        exact += [(prompt, r) for r in resp]
    t_exact = time.perf_counter() - t0

    def describe(rows):
        """Per completion: length, stopped (0/1), mean entropy of the base model over its positions."""
        lengths, stopped, entropy = [], [], []
        for prompt, resp in rows:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(resp)]
            logp = torch.log_softmax(logits.double(), dim=-1)
            entropy.append(float(-(logp.exp() * logp).sum(-1).mean()))
            lengths.append(float(len(resp)))
            stopped.append(float(bool(resp) and resp[-1] in stops))
        return {"length": lengths, "stopped": stopped, "entropy": entropy}

    sides = {"ours": describe(ours), "transformers": describe(theirs), "exact": describe(exact)}
    perm = torch.Generator().manual_seed(seed + 1)
    lines = [f"     sequences: {len(prompts)} prompts x {samples} completions per side (ours {t_ours:.0f} s, "
             f"transformers generate {t_hf:.0f} s, exact referee {t_exact:.0f} s)"]
    for left, right in (("ours", "transformers"), ("ours", "exact"), ("transformers", "exact")):
        for key in ("length", "stopped", "entropy"):
            x = torch.tensor(sides[left][key], dtype=torch.float64)
            y = torch.tensor(sides[right][key], dtype=torch.float64)
            pooled, n = torch.cat([x, y]), x.numel()
            observed = float(x.mean() - y.mean())
            diffs = []
            for _ in range(2000):
                idx = torch.randperm(pooled.numel(), generator=perm)
                diffs.append(float(pooled[idx[:n]].mean() - pooled[idx[n:]].mean()))
            p = (sum(abs(d) >= abs(observed) - 1e-12 for d in diffs) + 1) / (len(diffs) + 1)
            lines.append(f"{verdict(p > 1e-3)} {key}: {left} {float(x.mean()):.4f} vs {right} {float(y.mean()):.4f} "
                         f"(difference {observed:+.4f}, permutation p = {p:.3f})")
    return lines


@contextmanager
def recorded_engine_draws() -> Iterator[Dict[int, List[tuple]]]:
    """While open, every token the native engine draws is recorded: row -> ``[(token, logprob, entropy)]``,
    the logprob and entropy (float64) of the distribution it was drawn from (the KV-cached decode's logits,
    taken inside ``sample_tokens``), in the order drawn."""
    import torch

    import torchtune_grpo.generation._native as native

    seen: Dict[int, List[tuple]] = {}
    original = native.sample_tokens

    def recording(logits, **kw):
        token = original(logits, **kw)
        rows = kw.get("noise_rows")
        rows = range(logits.size(0)) if rows is None else rows.tolist()
        logp = torch.log_softmax(logits.double() / kw.get("temperature", 1.0), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        picked = logp.gather(-1, token.view(-1, 1)).squeeze(-1)
        for i, r in enumerate(rows):
            seen.setdefault(int(r), []).append((int(token[i]), float(picked[i]), float(ent[i])))
        return token

    native.sample_tokens = recording
    try:
        yield seen
    finally:
        native.sample_tokens = original


def engine_vs_trainer(model, prompt_ids: List[List[int]], response_ids: List[List[int]],
                      seen: Dict[int, List[tuple]], pad_id: int, temperature: float = 1.0):
    """The recorded draws (:func:`recorded_engine_draws`, row ``i`` = ``response_ids[i]``) against a full
    teacher-forced forward of the finished sequences with ``model`` (``sequence_logprobs``, the trainer's
    code). Returns ``(|logprob diffs|, |entropy diffs|, rows not aligned, tokens compared)``."""
    import torch

    from torchtune_grpo.models.logprobs import sequence_logprobs
    from torchtune_grpo.training.batch import pack_sequences

    tokens, _ = pack_sequences(prompt_ids, response_ids, pad_id)
    with torch.no_grad():
        ref = sequence_logprobs(model, tokens, temperature=temperature, with_entropy=True)
    lp_diffs, ent_diffs, misaligned, compared = [], [], 0, 0
    for row, (prompt, resp) in enumerate(zip(prompt_ids, response_ids)):
        record = seen.get(row, [])[: len(resp)]
        if [t for t, _, _ in record] != list(resp):
            misaligned += 1
            continue
        start = len(prompt) - 1
        for j, (_, lp, ent) in enumerate(record):
            lp_diffs.append(abs(lp - float(ref.logprobs[row, start + j])))
            ent_diffs.append(abs(ent - float(ref.entropy[row, start + j])))
        compared += len(resp)
    return lp_diffs, ent_diffs, misaligned, compared


def engine_logprob_check(recipe, prompts: List[List[int]], samples: int, seed: int) -> List[str]:
    """The native engine's own sampling distribution against the trainer's forward, on the same tokens.

    The engine samples ``samples`` completions of every prompt (the recipe's settings, 48 tokens); every
    distribution it samples from is recorded with the sampled token (:func:`recorded_engine_draws`) and
    compared with a full teacher-forced forward of the finished sequences (:func:`engine_vs_trainer`): the
    sampled tokens' logprobs and the entropies. Equal to fp32 rounding means the engine samples from exactly
    the policy the trainer scores, whatever the weights (run it with ``--model-dir`` on a trained checkpoint).
    """
    import torch

    tok = recipe.tokenizer
    stops = list(tok.stop_tokens)
    model = recipe.model
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    lp_diffs, ent_diffs, misaligned, tokens_seen = [], [], 0, 0
    for prompt in prompts:
        with recorded_engine_draws() as seen, recipe.generation_context():
            rollout = recipe.engine.generate(model, [prompt], group_size=samples, max_new_tokens=48,
                                              pad_id=tok.pad_id, stop_tokens=stops, generator=gen)
        lp, ent, bad, n = engine_vs_trainer(model, rollout.prompt_ids, rollout.response_ids, seen, tok.pad_id,
                                            recipe.engine.temperature)
        lp_diffs, ent_diffs, misaligned, tokens_seen = lp_diffs + lp, ent_diffs + ent, misaligned + bad, tokens_seen + n
    lp_t, ent_t = torch.tensor(lp_diffs), torch.tensor(ent_diffs)
    ok = misaligned == 0 and tokens_seen > 0 and float(lp_t.max()) < 1e-3
    return [f"{verdict(ok)} engine vs trainer on {tokens_seen} sampled tokens ({len(prompts)} prompts x {samples}; "
            f"{misaligned} rows not aligned): |logprob diff| max {float(lp_t.max()):.2e}, mean {float(lp_t.mean()):.2e}; "
            f"|entropy diff| max {float(ent_t.max()):.2e}, mean {float(ent_t.mean()):.2e}"]


# ------------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--out", default="parity_checks")
    parser.add_argument("--samples", type=int, default=2000, help="draws for the sampling check")
    parser.add_argument("--checks", nargs="+", default=["update", "sampling", "defaults"],
                        choices=["update", "sampling", "sequences", "engine_logprobs", "defaults"])
    parser.add_argument("--sequences", type=int, default=128, help="completions per prompt and side for 'sequences'")
    parser.add_argument("--tol", type=float, default=1e-3, help="relative tolerance of tensor comparisons")
    parser.add_argument("--reuse", action="store_true", help="reuse --out's rollouts.pt and trl_result.pt")
    args = parser.parse_args(argv)

    import torch

    from smollm2 import prepare_smollm2

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_smollm2(Path(args.model_dir or out / "smollm2-135m").resolve())
    task_dir = out / "task"
    bench.build_task(model_dir, task_dir)
    recipe = build_recipe(model_dir, task_dir, out)
    report: List[str] = []

    if "defaults" in args.checks or "update" in args.checks:
        if args.reuse and (out / "trl_result.pt").exists():
            data = torch.load(out / "rollouts.pt")
            rollouts = rollouts_from(data, recipe.tokenizer)
            t0 = time.perf_counter()
        else:
            batch = recipe.prompts.next()
            rollouts = recipe.step.rollouts.round(recipe.model, batch)  # our engine, our rewards; then rewards fixed below
            rollouts.rewards = torch.tensor(FIXED_REWARDS[: len(rollouts.response_ids)])
            data = {"prompts": [bench.read_jsonl(out / "train_order.jsonl")[i]["prompt"] for i in range(GROUPS)],
                    "answers": [f["answer"] for f in rollouts.fields], "prompt_ids": rollouts.prompt_ids,
                    "response_ids": rollouts.response_ids, "rewards": FIXED_REWARDS[: len(rollouts.response_ids)],
                    "truncated": rollouts.truncated.tolist()}
            torch.save(data, out / "rollouts.pt")
            t0 = time.perf_counter()
            run_trl_child(args.trl_python, model_dir, out)
        eos = recipe.tokenizer.stop_tokens
        ended = [r[-1] in eos for r in rollouts.response_ids]
        report.append(f"     rollouts: lengths {[len(r) for r in rollouts.response_ids]}, ending with a stop token "
                      f"{ended} (stop tokens {eos}), completions {[c[:40] for c in rollouts.completions]}")
        trl = torch.load(out / "trl_result.pt")
        ours = run_ours(recipe, rollouts, model_dir)
        ref = reference_update(model_dir, data, ours["advantages"])
        report.append(f"     TRL {trl['trl_version']}; both updates and the float64 referee took "
                      f"{time.perf_counter() - t0:.0f} s")
        report += compare_update(ours, trl, args.tol)
        report += compare_reference(ours, trl, ref)
        s = recipe.engine
        report.append(f"     defaults: ours NativeGenerator temperature={s.temperature} top_k={getattr(s, 'top_k', None)} "
                      f"top_p={getattr(s, 'top_p', None)}; TRL GRPOConfig defaults {trl['config_defaults']}; "
                      f"TRL generation config used {trl['generation_config']}; TRL AdamW {trl['adam']}; "
                      f"ours AdamW {({k: v for k, v in recipe.optimizer.defaults.items() if k in ('lr', 'betas', 'eps', 'amsgrad')})}, "
                      f"weight decay per group {sorted({g['weight_decay'] for g in recipe.optimizer.param_groups})}")
        for line in report:
            print(line, flush=True)
        del ours, trl, ref
        recipe.cleanup()  # ends its process group; a fresh recipe (base weights) samples below
        recipe = build_recipe(model_dir, task_dir, out)
    if "sampling" in args.checks:
        prompt = bench.read_jsonl(task_dir / "heldout.jsonl")[0]["tokens"]
        report += sampling_check(recipe, prompt, args.samples, seed=1)
    if "sequences" in args.checks:
        prompts = [r["tokens"] for r in bench.read_jsonl(out / "train_order.jsonl")[:4]]
        report += sequence_check(recipe, model_dir, prompts, args.sequences, seed=2)
    if "engine_logprobs" in args.checks:
        prompts = [r["tokens"] for r in bench.read_jsonl(out / "train_order.jsonl")[:4]]
        report += engine_logprob_check(recipe, prompts, args.sequences, seed=3)
    text = "\n".join(report)
    print("\n" + text)
    (out / "parity_report.txt").write_text(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_trl":
        run_trl(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        os._exit(0)
    main()
