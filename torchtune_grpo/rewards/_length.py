"""Length-aware reward shaping: DAPO's soft overlong punishment."""

from typing import List

from torchtune_grpo.rewards._base import Reward, RewardBatch

__all__ = ["SoftOverlongPunishment"]


class SoftOverlongPunishment(Reward):
    """A penalty that grows linearly over the last ``buffer_length`` tokens of the length budget.

    DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.4, "Overlong Reward Shaping"), with ``|y|`` the completion's length in
    tokens (its stop token included), ``L_max = max_length`` and ``L_cache = buffer_length``::

        R_length(y) = 0                                    if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                      -1                                   if |y| > L_max

    so a completion that runs into the budget is told "too long" gradually rather than by the cliff of a
    truncated (usually wrong) answer. Add it to ``reward_functions`` next to the task reward; its YAML
    ``weight`` scales it (verl's ``overlong_penalty_factor``). With ``max_length`` equal to the
    generation budget (``${max_response_length}``, as DAPO) the last case cannot happen.

    Args:
        max_length (int): ``L_max``, in tokens; typically ``${max_response_length}``.
        buffer_length (int): ``L_cache``, the soft-punishment interval, ``0 < buffer_length <= max_length``.
            DAPO uses 4096 of a 20480 budget.

    Raises:
        ValueError: on a non-positive ``max_length`` or a ``buffer_length`` outside ``(0, max_length]``.
    """

    name = "soft_overlong"

    def __init__(self, max_length: int, buffer_length: int) -> None:
        if int(max_length) <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        if not 0 < int(buffer_length) <= int(max_length):
            raise ValueError(f"buffer_length must be in (0, max_length={max_length}], got {buffer_length}")
        self.max_length = int(max_length)
        self.buffer_length = int(buffer_length)

    def __call__(self, batch: RewardBatch) -> List[float]:
        expected = self.max_length - self.buffer_length  # longest length with no penalty
        scores = []
        for ids in batch.completion_ids:
            n = len(ids)
            if n > self.max_length:
                scores.append(-1.0)
            else:
                scores.append(min(0.0, (expected - n) / self.buffer_length))
        return scores
