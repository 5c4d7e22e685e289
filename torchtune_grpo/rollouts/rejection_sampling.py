"""Rejection sampling (stage 3 of DeepSeek-R1, arXiv:2501.12948): keep a model's own correct completions.

``N`` completions are sampled per prompt; those whose reward (one component, or the weighted total) is
``>= threshold`` are kept, at most ``M`` distinct ones per prompt, and written as a jsonl SFT dataset that
torchtune's SFT recipes read through :func:`torchtune_grpo.data.sft_dataset` (``response_column:
response``: the prompt is rebuilt from ``question`` with the same prompt style) or torchtune's own
``instruct_dataset`` (``column_map: {input: prompt, output: response}``). See docs/pipeline.md.

Pure like the other stage modules: no config reading, no ``torch.distributed``; ``tune-grpo
rejection-sample`` wires it to a config.
"""

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from torchtune_grpo.data import collate_prompts
from torchtune_grpo.rollouts.groups import sample_and_score

__all__ = ["RejectionStats", "rejection_sample", "write_jsonl"]


class RejectionStats(NamedTuple):
    """Counts of one rejection-sampling run.

    Attributes:
        prompts (int): prompts sampled.
        samples (int): completions sampled (``prompts x num_samples``).
        passed (int): completions at or above the threshold (duplicates included).
        kept (int): rows written (distinct, at most ``max_per_prompt`` per prompt).
        prompts_kept (int): prompts with at least one row.
    """

    prompts: int
    samples: int
    passed: int
    kept: int
    prompts_kept: int


@torch.no_grad()
def rejection_sample(
    model: torch.nn.Module,
    tokenizer,
    engine,
    prompts: Sequence[Dict[str, Any]],
    rewards,
    *,
    num_samples: int,
    max_new_tokens: int,
    max_per_prompt: Optional[int] = None,
    threshold: float = 1.0,
    reward_name: Optional[str] = None,
    batch_size: int = 8,
    generator: Optional[torch.Generator] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> "tuple[List[Dict[str, Any]], RejectionStats]":
    """Sample ``num_samples`` completions per prompt and keep those scoring ``>= threshold``.

    Args:
        model (torch.nn.Module): a torchtune decoder.
        tokenizer: its tokenizer.
        engine: a generation engine (``generate(model, prompts, group_size=...)``); its temperature is used.
        prompts (Sequence[Dict[str, Any]]): dataset items ``{"tokens", "prompt", "answer", ...}``.
        rewards: a :class:`~torchtune_grpo.rewards.RewardSet`.
        num_samples (int): completions per prompt (N).
        max_new_tokens (int): response budget; truncated completions (no stop token) are never kept.
        max_per_prompt (Optional[int]): at most this many distinct completions per prompt (M).
            Default is None (all that pass).
        threshold (float): keep a completion when its score is ``>= threshold``. Default is 1.0.
        reward_name (Optional[str]): the component scored; None uses the weighted total. Default is None.
        batch_size (int): prompts per generation call. Default is 8.
        generator (Optional[torch.Generator]): sampling RNG. Default is None.
        progress (Optional[Callable[[int], None]]): called with the prompts done per batch. Default is None.

    Returns:
        tuple[List[Dict[str, Any]], RejectionStats]: rows ``{"question", "answer", "prompt", "response",
        "reward"}`` and counts.

    Raises:
        ValueError: on ``num_samples < 1`` or an unknown ``reward_name``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if reward_name is not None and reward_name not in rewards.names:
        raise ValueError(f"no reward component named '{reward_name}'; the reward set has {list(rewards.names)}")
    was_training = model.training
    model.eval()
    rows: List[Dict[str, Any]] = []
    passed = prompts_kept = 0
    g = num_samples
    try:
        for start in range(0, len(prompts), batch_size):
            items = [prompts[i] for i in range(start, min(start + batch_size, len(prompts)))]
            batch = collate_prompts(items)
            scored = sample_and_score(
                model, tokenizer, engine, batch, rewards, group_size=g, max_new_tokens=max_new_tokens,
                generator=generator,
            )
            completions = scored.completions
            scores = (scored.rewards if reward_name is None else scored.per_component[reward_name]).tolist()
            truncated = scored.truncated.tolist()
            for p, item in enumerate(items):
                seen, kept_here = set(), 0
                for i in range(p * g, (p + 1) * g):
                    if truncated[i] or scores[i] < threshold:
                        continue
                    passed += 1
                    text = completions[i].strip()
                    if text in seen or (max_per_prompt is not None and kept_here >= max_per_prompt):
                        continue
                    seen.add(text)
                    kept_here += 1
                    rows.append(
                        {
                            "question": item.get("question", item["prompt"]),
                            "answer": item.get("answer"),
                            "prompt": item["prompt"],
                            "response": completions[i],
                            "reward": scores[i],
                        }
                    )
                prompts_kept += kept_here > 0
            if progress is not None:
                progress(len(items))
    finally:
        model.train(was_training)
    stats = RejectionStats(len(prompts), len(prompts) * g, passed, len(rows), prompts_kept)
    return rows, stats


def write_jsonl(rows: Sequence[Dict[str, Any]], path: "str | Path") -> Path:
    """Write ``rows`` one JSON object per line (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
