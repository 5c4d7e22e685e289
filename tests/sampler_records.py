"""What the native engine's sampler saw, for tests that compare two decode paths under one seed.

:func:`record_sampler` wraps ``_native.sample_tokens``; :func:`flip_chance` bounds how likely equal tokens from two
runs were to differ through rounding alone.
"""

from typing import List, Tuple

import torch

from torchtune_grpo.generation import _native

Step = Tuple[torch.Tensor, torch.Tensor]


def record_sampler(monkeypatch) -> List[List[Step]]:
    """Record every call of the engine's sampler, until the test ends.

    Returns:
        List[List[Step]]: one list per ``generate`` (the test appends an empty list before each), one entry per
        step: ``[N, V]`` logits of the whole batch (NaN for rows not in the decode batch) and the ``[N]`` tokens
        drawn (-1 likewise), on CPU.
    """
    runs: List[List[Step]] = []
    original = _native.sample_tokens

    def recording(logits, **kw):
        token = original(logits, **kw)
        rows = kw.get("noise_rows")
        n = kw.get("noise_batch") or logits.size(0)
        full = torch.full((n, logits.size(1)), float("nan"))
        drawn = torch.full((n,), -1, dtype=torch.long)
        index = rows.cpu() if rows is not None else torch.arange(n)
        full[index], drawn[index] = logits.float().cpu(), token.cpu()
        runs[-1].append((full, drawn))
        return token

    monkeypatch.setattr(_native, "sample_tokens", recording)
    return runs


def flip_chance(first: List[Step], second: List[Step]) -> float:
    """An upper bound on the chance that two runs' seeded draws differ through their logits' rounding alone.

    A draw flips only if its uniform falls between a CDF entry of one run and the same entry of the other, so the
    chance is at most the sum over vocabulary entries of ``|CDF_a - CDF_b|``, summed over every step and row both
    runs sampled (float64 softmax of each run's logits).
    """
    total = 0.0
    for (a, _), (b, _) in zip(first, second):
        both = ~(a.isnan().any(1) | b.isnan().any(1))
        cdf_a, cdf_b = (torch.softmax(x[both].double(), -1).cumsum(-1) for x in (a, b))
        total += float((cdf_a - cdf_b).abs().sum())
    return total


def sampled_logprobs(responses: List[List[int]], steps: List[Step]) -> torch.Tensor:
    """The log-probability of every sampled token under the logits it was drawn from, row by row (float64).

    Args:
        responses (List[List[int]]): the rollout's response tokens, one list per row.
        steps (List[Step]): one ``generate``'s recorded sampler steps (:func:`record_sampler`).

    Returns:
        torch.Tensor: ``[total response tokens]``, row 0's tokens first. Asserts each token is the one drawn.
    """
    out = []
    for i, response in enumerate(responses):
        for j, token in enumerate(response):
            logits, drawn = steps[j]
            assert int(drawn[i]) == token
            out.append(torch.log_softmax(logits[i].double(), -1)[token])
    return torch.stack(out)
