"""The result of a rollout, and its completions as text."""

import weakref
from typing import List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

__all__ = ["Rollout", "decode_responses", "rollout_from_requests"]


class Rollout(NamedTuple):
    """``N = num_prompts x group_size`` sampled completions; row ``i`` answers prompt ``i // group_size``.

    Attributes:
        prompt_ids (List[List[int]]): the prompt of each row (unpadded), length N.
        response_ids (List[List[int]]): each completion up to and including its stop token, length N.
        truncated (torch.Tensor): ``[N]`` bool, True where no stop token came within the budget.
        logprobs (Optional[List[List[float]]]): the engine's log-probability of each sampled response
            token (one per entry of ``response_ids``), under the distribution it sampled from; None when
            the engine samples with the trainer's own model (the native engine), whose logprobs the
            trainer computes itself. Default is None.
        token_versions (Optional[List[List[int]]]): per row and response token, the weight version (weight
            syncs the engine had received) that sampled it: an engine that takes weights while it generates
            (``VLLMServerGenerator.load_weights(..., in_flight=True)``) can sample one completion with several.
            None when every token came from the weights the engine held when asked. Default is None.
        routed_experts (Optional[List[torch.Tensor]]): a mixture-of-experts model's routes: per row, int16
            ``[len(prompt) + len(response), num_moe_layers, top_k]``, the experts the engine chose for the token
            at each position *as an input token* (position ``p`` = the token at ``p``), -1 where it reported none
            (the trainer routes those itself). None for a dense model or an engine that does not report them.
            Default is None.
    """

    prompt_ids: List[List[int]]
    response_ids: List[List[int]]
    truncated: torch.Tensor
    logprobs: Optional[List[List[float]]] = None
    token_versions: Optional[List[List[int]]] = None
    routed_experts: Optional[List[torch.Tensor]] = None


def decode_responses(tokenizer, response_ids: List[List[int]]) -> List[str]:
    """Decode completions to text (special tokens skipped), never failing on an id.

    A model's embedding table is usually larger than its tokenizer's vocabulary (Qwen2.5: 151,936 rows,
    about 151,665 tokens), and an untrained or diverging model can sample an id the tokenizer cannot
    decode. Such ids are dropped from the text instead of crashing the run; the token ids themselves are
    unchanged for training. Each id is tried alone at most once per tokenizer: the undecodable ones are
    remembered (a random model's rollout otherwise costs one decode call per token).

    Args:
        tokenizer: a torchtune tokenizer with ``decode(ids, skip_special_tokens=...)``.
        response_ids (List[List[int]]): N completions.

    Returns:
        List[str]: N texts.
    """
    texts = []
    bad = _undecodable_ids(tokenizer)
    for ids in response_ids:
        if bad:
            ids = [t for t in ids if t not in bad]
        try:
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            continue
        except Exception:  # noqa: BLE001 - any tokenizer's failure on an unknown id
            pass
        for token in set(ids):
            try:
                tokenizer.decode([token], skip_special_tokens=True)
            except Exception:  # noqa: BLE001
                bad.add(token)
        texts.append(tokenizer.decode([t for t in ids if t not in bad], skip_special_tokens=True))
    return texts


_UNDECODABLE: "weakref.WeakKeyDictionary[object, Set[int]]" = weakref.WeakKeyDictionary()


def _undecodable_ids(tokenizer) -> Set[int]:
    """The ids ``tokenizer`` failed to decode so far (a fresh set if it cannot be weakly referenced)."""
    try:
        return _UNDECODABLE.setdefault(tokenizer, set())
    except TypeError:
        return set()


def rollout_from_requests(
    prompts: List[List[int]],
    completions: Sequence[Sequence[Tuple]],
    group_size: int,
    stop: Set[int],
    source: str,
) -> Rollout:
    """A :class:`Rollout` from one sampling request per prompt (vLLM in process or as a server).

    Args:
        prompts (List[List[int]]): B prompts as token ids.
        completions (Sequence[Sequence[Tuple]]): per prompt, its ``(token ids, sampled logprobs)`` or ``(token
            ids, sampled logprobs, token versions)`` completions in order; a single one (greedy: asked for
            once) stands for all G.
        group_size (int): G.
        stop (Set[int]): stop token ids.
        source (str): who answered, for the error.

    Returns:
        Rollout: ``B x G`` rows with ``logprobs`` (and ``token_versions`` when the completions carry them).

    Raises:
        RuntimeError: a prompt came back with neither 1 nor G completions.
    """
    prompt_ids, response_ids, logprobs, truncated, versions = [], [], [], [], []
    for prompt, answers in zip(prompts, completions):
        answers = list(answers)
        if len(answers) == 1:
            answers = answers * group_size
        if len(answers) != group_size:
            raise RuntimeError(f"{source} returned {len(answers)} completions for a prompt, not {group_size}")
        for ids, lps, *token_versions in answers:
            prompt_ids.append(list(prompt))
            response_ids.append(list(ids))
            logprobs.append(list(lps))
            versions.append(list(token_versions[0]) if token_versions else None)
            # Truncated = no stop token (as the native engine: a stop token that is also the budget's last
            # token still ends the completion).
            truncated.append(not ids or ids[-1] not in stop)
    return Rollout(prompt_ids=prompt_ids, response_ids=response_ids,
                   truncated=torch.tensor(truncated, dtype=torch.bool), logprobs=logprobs,
                   token_versions=versions if versions and all(v is not None for v in versions) else None)
