"""The algorithm card: an exact, human-readable statement of what a run optimises.

The recipe builds an :class:`AlgorithmSpec` from its resolved config at start-up, prints
:func:`algorithm_card` and writes it to ``${output_dir}/algorithm_card.md``. It answers the questions users
of GRPO trainers keep asking: which loss (aggregation, clipping, KL estimator and where the KL goes), which
advantage, how many prompts and samples make one optimizer step, how many optimizer steps reuse one
generation round (how off-policy the updates are), and whether a reference model is in memory.

Everything here is pure: plain values in, markdown out.
"""

import math
import os
from typing import List, Tuple

from torchtune_grpo.config.algorithm_spec import AlgorithmSpec, config_values
from torchtune_grpo.loss.grpo import ppo_formula_lines

__all__ = ["AlgorithmSpec", "algorithm_card", "config_values", "write_algorithm_card"]

_AGGREGATION = {
    "token-mean": ("L = (1 / M) * sum_i sum_t l_i,t", "every token weighs the same (DAPO)"),
    "seq-mean-token-mean": (
        "L = (1 / N) * sum_i (1 / |o_i|) * sum_t l_i,t",
        "every sequence weighs the same (GRPO, GSPO)",
    ),
    "seq-mean-token-sum": ("L = (1 / N) * sum_i sum_t l_i,t", "sum over tokens, mean over sequences"),
    "seq-mean-token-sum-norm": (
        "L = (1 / (N * {L_max})) * sum_i sum_t l_i,t",
        "constant normaliser N x max_response_length, no length bias (Dr. GRPO)",
    ),
}

_KL_FORMULA = {
    "k1": "k1 = -d",
    "k2": "k2 = d^2 / 2",
    "k3": "k3 = exp(d) - d - 1",
    "k3+": "k3+ = exp(d) - d - 1 in value, gradient of d^2 / 2 (straight-through)",
}


def _g(x: float) -> str:
    return f"{x:g}"


def _off_policy(epochs: int, k: int) -> str:
    """How stale each optimizer step of a generation round is (all ratios are against pi_old)."""
    steps = epochs * k
    if steps == 1:
        return "on-policy: every update uses rollouts of the current weights (ratio = 1)"
    what = []
    if k > 1:
        what.append(f"each pass splits the rollouts into {k} disjoint mini-batches, one update each")
    if epochs > 1:
        what.append(f"{epochs} passes reuse the same rollouts")
    return (
        f"update 1 is on-policy; update j runs j - 1 updates after the weights that sampled, up to {steps - 1} "
        f"update(s) stale ({'; '.join(what)}; ratios are against the sampling policy pi_old, clipping acts there)"
    )


def _micro_row(s: AlgorithmSpec, local: int, micro: int) -> Tuple[str, str, str]:
    if s.max_tokens_per_micro_batch is None:
        return (
            "micro-batches per process per optimizer step",
            str(micro),
            f"ceil({local} / micro_batch_size {s.micro_batch_size}): gradient accumulation, same update",
        )
    return (
        "micro-batches per process per optimizer step",
        f"{micro} to {local}",
        f"by length: up to max_tokens_per_micro_batch {s.max_tokens_per_micro_batch} tokens (padding included) "
        f"and micro_batch_size {s.micro_batch_size} sequences each, as many on every process; gradient "
        "accumulation, same update",
    )


def _batch_table(s: AlgorithmSpec) -> List[str]:
    k = s.ppo_mini_batches
    round_prompts = s.batch_size * s.world_size  # per generation round
    prompts = round_prompts // k  # per optimizer step
    seqs = prompts * s.group_size
    local = s.batch_size * s.group_size // k
    micro = math.ceil(local / max(1, min(s.micro_batch_size, local)))
    off_policy = _off_policy(s.ppo_epochs, k)
    per_step = f"batch_size {s.batch_size} x {s.world_size} process(es)"
    if k > 1:
        order = "reshuffled before every pass" if s.ppo_mini_batch_shuffle else "in rollout order"
        per_step += f" / ppo_mini_batches {k} (whole groups, {order})"
    if s.dynamic_sampling:
        consumed = (
            f"{round_prompts} to {round_prompts * s.max_rounds} ({s.batch_size} x {s.world_size} per round, 1 to "
            f"{s.max_rounds} rounds)"
        )
        consumed_note = "dynamic sampling: extra rounds on new prompts until every process has informative groups"
    else:
        consumed, consumed_note = str(round_prompts), "one generation round per step"
    if s.reference_model:
        ref = (s.reference_description, f"kl_coef = {_g(s.kl_coef)} > 0; reference.precision, reference.offload")
    else:
        ref = ("not loaded", "kl_coef = 0")
    rows = [
        ("processes", str(s.world_size), "world size"),
        ("prompts per optimizer step", str(prompts), per_step),
        ("samples per prompt (G)", str(s.group_size), "group_size"),
        (
            "sequences per optimizer step (effective global batch)",
            str(seqs),
            f"{prompts} prompts x G {s.group_size}; the loss is normalised over all of them",
        ),
        _micro_row(s, local, micro),
        (
            "optimizer steps per generation round",
            str(s.ppo_epochs * k),
            ("ppo_epochs" if k == 1 else f"ppo_epochs {s.ppo_epochs} x ppo_mini_batches {k}") + f"; {off_policy}",
        ),
        ("prompts consumed per step", consumed, consumed_note),
        ("reference model", ref[0], ref[1]),
    ]
    out = ["| quantity | value | from |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return out


def _objective(s: AlgorithmSpec) -> List[str]:
    lines = list(s.policy_lines or ppo_formula_lines(s.epsilon_low, s.epsilon_high, s.dual_clip, s.ratio_level))
    if s.tis_cap is not None:
        lines.append(
            f"           times min(pi_old(o_i,t) / mu(o_i,t), {_g(s.tis_cap)}), mu = the generation engine's "
            "sampling probability   [truncated importance sampling]"
        )
    lines += s.rollout_correction or []
    if s.token_selection:
        lines.append(s.token_selection)
    per_token = "p_i,t"
    if s.kl_coef > 0 and s.kl_placement == "loss":
        per_token += f" + {_g(s.kl_coef)} * {s.kl_estimator}_i,t"
    if s.entropy_coef > 0:
        per_token += f" - {_g(s.entropy_coef)} * H_i,t"
    lines.append(f"per token  l_i,t = {per_token}")
    if s.kl_coef > 0:
        lines.append(
            f"KL         {_KL_FORMULA[s.kl_estimator]},  d = log pi_ref(o_i,t) - log pi(o_i,t)   "
            f"[estimator {s.kl_estimator}]"
        )
    if s.entropy_coef > 0:
        lines.append("entropy    H_i,t = entropy of pi_theta(. | q, o_i,<t)   [bonus]")
    formula, why = _AGGREGATION[s.loss_agg_mode]
    lines.append(f"loss       {formula.format(L_max=s.max_response_length)}   [{s.loss_agg_mode}: {why}]")
    if s.routing_replay is not None and (s.load_balance_coef > 0 or s.z_loss_coef > 0):
        lines.append(
            f"router     L += {_g(s.load_balance_coef)} * LB + {_g(s.z_loss_coef)} * Z,  LB = E * sum_e f_e * "
            "mean_t p_t,e  [Switch load balancing; f_e: the batch's share of routings to expert e, a constant],  "
            "Z = mean_t (logsumexp_e z_t,e)^2  [ST-MoE z-loss]; means over the real tokens, averaged over MoE layers"
        )
    lines.append(f"advantage  {s.advantage}")
    reward = " + ".join(f"{_g(w)} * {name}" for name, w in s.rewards) or "(none)"
    if s.kl_coef > 0 and s.kl_placement == "reward":
        reward += f" - {_g(s.kl_coef)} * sum_t {s.kl_estimator}(log pi_old, log pi_ref)_i,t   [KL in the reward]"
    lines.append(f"reward     R_i = {reward}")
    if s.step_reward is not None:
        used = (
            f"; the advantage reads r_i,j, and its R_i leaves {s.step_reward} out"
            if s.token_level_advantage else "; the advantage sees only R_i"
        )
        lines.append(
            f"steps      r_i,j = {s.step_reward}'s score of step j of o_i (a step-level reward; its term in R_i "
            f"is one number from them){used}"
        )
    return lines


def _notes(s: AlgorithmSpec) -> List[str]:
    seqs = "N = number of sequences" + (" not truncated" if s.mask_truncated_completions else "")
    tokens = "their action tokens (the model's own)" if s.environment else "their response tokens"
    notes = [
        f"- Sums run over the global batch: {seqs}, M = {tokens}, summed over all "
        "micro-batches and processes before any division, so the update does not depend on "
        "micro_batch_size or on the number of processes.",
        "- pi_old is the policy that generated the rollouts (no gradient); pi_ref the initial policy.",
    ]
    if s.reference_model and ("int8" in s.reference_description or "NF4" in s.reference_description):
        notes.append(
            "- pi_ref is computed by a quantised copy of the initial policy (see \"reference model\" above): "
            "log pi_ref carries its quantisation error, measured in docs/algorithms.md."
        )
    if s.environment:
        notes.append(
            f"- Multi-turn episodes ({s.environment}): o_i is a whole episode, the model's turns with the "
            "environment's replies between them, and t runs over the model's own tokens only. The tokens the "
            "environment injected (tool results, observations) are context: they are masked out of every loss "
            "term (policy, ratio, KL, entropy, the KL-in-reward sum) and of every count (M, |o_i|)."
        )
    if s.kl_coef == 0:
        notes.append("- No KL term: kl_coef = 0, so no reference model is loaded.")
    elif s.kl_placement == "loss":
        notes.append(f"- KL placement: loss (a per-token term weighted {_g(s.kl_coef)}, aggregated like the policy term).")
    else:
        notes.append(
            "- KL placement: reward. The penalty uses the sampling policy's log-probabilities, is summed over "
            "each sequence and subtracted from R_i before the advantage; it has no gradient of its own."
        )
    if s.rollout_correction:
        notes.append(
            "- Rollout correction: weights and masks come from pi_old and mu only, decided before the update; "
            "tokens and sequences it masks leave M and N (counted after masking, over all processes)."
        )
    if s.mask_truncated_completions:
        notes.append(
            "- Truncated completions (no stop token within max_response_length) are masked out of the loss "
            "(DAPO overlong filtering); they still count in their group's advantage baseline."
        )
    if s.dynamic_sampling:
        notes.append(
            f"- Dynamic sampling (DAPO): groups whose rewards are all equal are dropped and up to "
            f"{s.max_rounds} generation rounds are run to fill the batch; if they run out, zero-variance groups "
            "fill it (zero advantage)."
        )
    if s.max_staleness is not None:
        k = s.max_staleness
        corrected = (
            "the loss corrects for it (truncated importance weights min(pi_old / mu, cap), or the rollout "
            "correction above)" if (s.tis_cap is not None or s.rollout_correction) else
            "nothing corrects for it (set loss.tis_cap or rollout_correction for the decoupled objective)"
        )
        notes.append(
            f"- Asynchronous rollouts: a generation worker per process samples batch j with the weights after "
            f"step max(start, j - 1 - {k}), so a sample is at most {k} training step(s) old when trained on "
            f"(max_staleness = {k}). mu is the worker's policy (its log-probabilities of the sampled tokens); "
            "pi_old is the trainer's policy at the start of the step (the proximal policy of decoupled PPO, "
            "Fu et al. 2025, arXiv:2505.24298)"
            + (f"; {corrected}." if k > 0 else "; at max_staleness 0 mu = pi_old.")
        )
        if s.in_flight_updates:
            notes.append(
                "- In-flight weight updates: a version that reaches a worker while it generates goes into its vLLM "
                "server at once and running completions continue with it (their keys and values recomputed), so "
                "one completion may span several versions: mu is per token the version that sampled it, and the "
                "bound counts each row's oldest token. Not reproducible run to run."
            )
    if s.optimizer:
        clip = f", gradient norm clipped to {_g(s.clip_grad_norm)}" if s.clip_grad_norm is not None else ""
        nonfinite = ("skipped (its gradients dropped)" if s.on_nonfinite == "skip"
                     else "never taken: the run stops")
        notes.append(f"- Optimizer: {s.optimizer}{clip}; an optimizer step with a NaN/inf gradient norm is {nonfinite}.")
    if s.policy_model:
        notes.append(f"- Policy model: {s.policy_model}.")
    if s.routing_replay is not None:
        replay = (
            "rollout: the experts the engine chose for every token (prompt and response, every MoE layer) are forced "
            "in the old, reference and policy forwards, gate weights recomputed from the live router (R3, "
            "arXiv:2510.11370); tokens the engine reported none for are routed by the trainer"
            if s.routing_replay == "rollout" else "off: the trainer routes every token itself"
        )
        notes.append(
            f"- Mixture of experts: routing replay {replay}. Load-balancing coefficient {_g(s.load_balance_coef)}, "
            f"router z-loss coefficient {_g(s.z_loss_coef)} (0: logged only, moe/load_balance_loss and moe/z_loss)."
        )
    if s.precision:
        notes.append(f"- Precision: {s.precision}.")
    if s.weight_sync:
        notes.append(f"- Generation engine weights: {s.weight_sync}.")
    return notes


def algorithm_card(spec: AlgorithmSpec) -> str:
    """Renders the algorithm card as markdown.

    Args:
        spec (AlgorithmSpec): the run's settings.

    Returns:
        str: the card, ending with a newline.
    """
    out = [
        "# Algorithm card",
        "",
        "What every optimizer step of this run minimises, stated from its resolved config.",
        "",
        "## Batch",
        "",
        *_batch_table(spec),
        "",
        "## Objective",
        "",
    ]
    if spec.loss_agg_mode is None:
        out += [f"Custom loss component `{spec.loss_name}`: see its documentation.", ""]
        out += ["```text", f"advantage  {spec.advantage}", "```"]
    else:
        completion = (
            "episode o_i of |o_i| action tokens (environment tokens excluded)" if spec.environment
            else "completion o_i of |o_i| tokens"
        )
        out += [
            f"Sequence i (of the N in the global batch) answers prompt q with {completion}; "
            + ("token t of it has its own advantage A_i,t, which takes the place of A_i below."
               if spec.token_level_advantage else "A_i is its advantage."),
            "",
            "```text",
            *_objective(spec),
            "```",
        ]
    out += ["", *_notes(spec), ""]
    return "\n".join(out)


def write_algorithm_card(spec: AlgorithmSpec, output_dir: str) -> str:
    """Write ``{output_dir}/algorithm_card.md`` and return the card's text."""
    card = algorithm_card(spec)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "algorithm_card.md"), "w", encoding="utf-8") as f:
        f.write(card)
    return card
