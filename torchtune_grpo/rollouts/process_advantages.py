"""Process-supervised advantages: one advantage per response token from step-level scores.

DeepSeekMath (Shao et al. 2024, arXiv:2402.03300, section 4.1.3, "Process Supervision RL with GRPO"): a
process reward model scores every reasoning step of each of the ``G`` completions of a prompt; the scores
of *all* steps of the group are normalised together,

    r~_i,j = (r_i,j - mean(R)) / (std(R) + eps),   R = {r_k,j : every step j of every completion k of the group}

and the advantage of token ``t`` of completion ``i`` is the sum of the normalised scores of the steps that
end at or after it,

    A_i,t = sum_{j : end(i, j) >= t} r~_i,j.

Combined with an outcome reward (section 4.1.2's per-completion ``A~_i = (o_i - mean_g) / (std_g + eps)``,
the same for every token of the completion) this estimator gives

    A_i,t = w_outcome * A~_i + w_process * sum_{j : end(i, j) >= t} r~_i,j

``w_outcome = 0, w_process = 1`` is section 4.1.3 (process only); ``w_outcome = w_process = 1`` is the
paper's return form with the outcome as one more reward at the last token (normalised within its own
kind, as the paper normalises each); other weights are a weighted sum. The step scores and boundaries come
from a step-level reward (:class:`~torchtune_grpo.rewards.StepReward`), the outcome from the other reward
components. Everything is computed within a group, so the result does not depend on how groups are split
over micro-batches or processes.
"""

from typing import List, NamedTuple, Optional, Sequence

import torch

from torchtune_grpo.rollouts.advantages import GroupRelativeAdvantage, ZERO_VARIANCE_RTOL

__all__ = ["ProcessAdvantageOutput", "ProcessSupervisedAdvantage", "check_steps"]


class ProcessAdvantageOutput(NamedTuple):
    """Token-level advantages of ``N = num_groups x G`` completions.

    Attributes:
        advantages (torch.Tensor): ``[N, L]`` float32, ``L`` the longest response; column ``t`` of row
            ``i`` is the advantage of response token ``t`` (0 past the row's end).
        normalized_steps (List[List[float]]): per row, ``r~_i,j`` of each step (before the weight).
        zero_std (torch.Tensor): ``[N // G]`` bool, groups whose step scores are all equal (they carry no
            process signal: every ``r~`` there is exactly 0).
    """

    advantages: torch.Tensor
    normalized_steps: List[List[float]]
    zero_std: torch.Tensor


def check_steps(step_scores: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                response_lengths: Sequence[int]) -> None:
    """Checks the step-level scores of ``N`` completions.

    Raises:
        ValueError: naming the row, when the lists differ in length, a row's scores and ends differ in
            count, an end is outside ``[0, length - 1]``, ends do not strictly increase, or a score is not
            finite.
    """
    if not len(step_scores) == len(step_ends) == len(response_lengths):
        raise ValueError(
            f"step scores of {len(step_scores)} rows, step ends of {len(step_ends)} and {len(response_lengths)} "
            "responses: one of each per completion"
        )
    for i, (scores, ends, length) in enumerate(zip(step_scores, step_ends, response_lengths)):
        if len(scores) != len(ends):
            raise ValueError(f"row {i}: {len(scores)} step scores but {len(ends)} step ends")
        for a, b in zip(ends, ends[1:]):
            if b <= a:
                raise ValueError(f"row {i}: step ends must strictly increase, got {list(ends)}")
        if ends and (ends[0] < 0 or ends[-1] > length - 1):
            raise ValueError(f"row {i}: step ends {list(ends)} outside the response's tokens 0..{length - 1}")
        for s in scores:
            if not torch.isfinite(torch.tensor(float(s))):
                raise ValueError(f"row {i}: step score {s} is not finite")


class ProcessSupervisedAdvantage:
    """DeepSeekMath's process-supervised GRPO advantage, optionally plus the outcome advantage (see the
    module docstring for the formula).

    Example YAML (with a step-level reward in ``reward_functions``)::

        advantage:
          _component_: torchtune_grpo.rollouts.process_advantages.ProcessSupervisedAdvantage
          outcome_weight: 1.0    # 0: process supervision only (DeepSeekMath 4.1.3)
          process_weight: 1.0

    Args:
        outcome_weight (float): ``w_outcome``, the weight of the group-normalised outcome advantage (the
            weighted sum of every reward component that is not step-level). Default is 0.0.
        process_weight (float): ``w_process``, the weight of the summed normalised step scores. Default
            is 1.0.
        eps (float): added to each standard deviation. Default is 1e-6.
        clip (Optional[float]): clamp each token's advantage to ``[-clip, clip]``. Default is None.

    Raises:
        ValueError: on a negative weight, both weights 0, ``eps < 0`` or ``clip <= 0``.
    """

    #: The advantages are per token ``[N, L]``, from step scores (the experience builder checks it).
    token_level: bool = True
    uses_batch_stats: bool = False
    normalize_components: bool = False

    def __init__(
        self, outcome_weight: float = 0.0, process_weight: float = 1.0, eps: float = 1e-6, clip: Optional[float] = None
    ) -> None:
        if outcome_weight < 0 or process_weight < 0:
            raise ValueError(f"weights must be >= 0, got outcome_weight={outcome_weight}, process_weight={process_weight}")
        if outcome_weight == 0 and process_weight == 0:
            raise ValueError("outcome_weight and process_weight are both 0: every advantage would be 0")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if clip is not None and clip <= 0:
            raise ValueError(f"clip must be > 0 (or null), got {clip}")
        self.outcome_weight = float(outcome_weight)
        self.process_weight = float(process_weight)
        self.eps = float(eps)
        self.clip = None if clip is None else float(clip)
        self._outcome = GroupRelativeAdvantage(scale_by_std=True, eps=eps)

    @property
    def formula(self) -> str:
        """The estimator as text (for the algorithm card)."""
        process = "sum_{j: end(i,j) >= t} (r_i,j - mean(R_steps)) / (std(R_steps) + %g)" % self.eps
        terms = []
        if self.outcome_weight:
            w = "" if self.outcome_weight == 1 else f"{self.outcome_weight:g} * "
            terms.append(f"{w}(R_i - mean(R_group)) / (std(R_group) + {self.eps:g})")
        if self.process_weight:
            w = "" if self.process_weight == 1 else f"{self.process_weight:g} * "
            terms.append(w + process)
        text = "A_i,t = " + " + ".join(terms)
        if self.clip is not None:
            text = f"clip({text}, -{self.clip:g}, {self.clip:g})"
        return (
            text + ";  r_i,j: the score of step j of completion i, R_steps: every step score of the group "
            "(sample std; 0 where all are equal), R_i: the outcome (the non-step reward components) "
            "[process supervision, DeepSeekMath 4.1.3]"
        )

    def _normalized_steps(self, step_scores: Sequence[Sequence[float]], group_size: int):
        """Per row, ``r~_i,j`` (float64 tensors), and the zero-variance groups ``[N // G]``."""
        rows: List[torch.Tensor] = []
        zero = []
        for g in range(len(step_scores) // group_size):
            group = [torch.tensor(list(step_scores[g * group_size + k]), dtype=torch.float64) for k in range(group_size)]
            values = torch.cat(group) if group else torch.zeros(0, dtype=torch.float64)
            # The same robust "all equal" test as the outcome estimators (zero_variance_groups): equal
            # scores that went through different float paths must give exactly 0, never noise / eps.
            flat = values.numel() < 2 or float(values.max() - values.min()) <= ZERO_VARIANCE_RTOL * max(
                1.0, abs(float(values.mean()))
            )
            zero.append(flat)
            if flat:
                rows.extend(torch.zeros_like(r) for r in group)
                continue
            mean, std = values.mean(), values.std(correction=1)  # sample std, as the outcome estimators
            rows.extend((r - mean) / (std + self.eps) for r in group)
        return rows, torch.tensor(zero, dtype=torch.bool)

    def __call__(
        self,
        outcome: torch.Tensor,
        step_scores: Sequence[Sequence[float]],
        step_ends: Sequence[Sequence[int]],
        response_lengths: Sequence[int],
        group_size: int,
    ) -> ProcessAdvantageOutput:
        """Computes token-level advantages.

        Args:
            outcome (torch.Tensor): ``[N]`` the outcome reward of each completion (ignored when
                ``outcome_weight`` is 0).
            step_scores (Sequence[Sequence[float]]): per completion, the score of each step.
            step_ends (Sequence[Sequence[int]]): per completion, the response-token index of each step's
                last token, strictly increasing.
            response_lengths (Sequence[int]): per completion, its number of response tokens.
            group_size (int): ``G``; completions ``g*G .. (g+1)*G - 1`` answer prompt ``g``.

        Returns:
            ProcessAdvantageOutput: ``advantages [N, L]`` float32 and the normalised step scores.

        Raises:
            ValueError: on malformed steps (see :func:`check_steps`), or ``N`` not a multiple of ``G``.
        """
        n = len(step_scores)
        if outcome.dim() != 1 or outcome.numel() != n:
            raise ValueError(f"outcome must be [N] = [{n}], got shape {tuple(outcome.shape)}")
        if group_size < 1 or n % group_size:
            raise ValueError(f"{n} completions are not groups of group_size={group_size}")
        check_steps(step_scores, step_ends, response_lengths)
        width = max([int(x) for x in response_lengths] + [0])
        normalized, zero_std = self._normalized_steps(step_scores, group_size)
        s_max = max([len(e) for e in step_ends] + [0])
        # [N, S + 1] normalised scores (0-padded), and ends padded past every token so that tokens after a
        # row's last step find a zero suffix.
        scores = torch.zeros((n, s_max + 1), dtype=torch.float64)
        ends = torch.full((n, s_max + 1), width, dtype=torch.long)
        for i in range(n):
            k = len(step_ends[i])
            scores[i, :k] = normalized[i]
            ends[i, :k] = torch.tensor(list(step_ends[i]), dtype=torch.long)
        suffix = scores.flip(1).cumsum(1).flip(1)  # [N, S + 1]: sum of the normalised scores from step j on
        t = torch.arange(width, dtype=torch.long).expand(n, width).contiguous()  # [N, L]
        first = torch.searchsorted(ends, t, side="left")  # first step with end >= t, [N, L]
        adv = self.process_weight * suffix.gather(1, first)  # [N, L]
        if self.outcome_weight:
            outcome_adv = self._outcome(outcome, group_size).advantages.to(torch.float64)  # [N]
            adv = adv + self.outcome_weight * outcome_adv.unsqueeze(1)
        lengths = torch.tensor([int(x) for x in response_lengths], dtype=torch.long)
        adv = torch.where(t < lengths.unsqueeze(1), adv, torch.zeros_like(adv))  # nothing past a row's end
        if self.clip is not None:
            adv = adv.clamp(-self.clip, self.clip)
        return ProcessAdvantageOutput(
            advantages=adv.to(torch.float32), normalized_steps=[r.tolist() for r in normalized], zero_std=zero_std
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.formula})"
