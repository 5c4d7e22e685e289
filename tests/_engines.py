"""A test-only generation engine whose completions are a fixed function of the prompt.

Recipe tests that compare runs with different splits of the same global batch (1 vs 2 processes) need
identical rollouts, but each rank samples with its own RNG. :class:`ScriptedGenerator` ignores the model and
the RNG: the completions of a prompt depend only on its token ids, so a prompt gets the same group on any
rank, in any run. It is a real ``generation`` component (``_component_: tests._engines.ScriptedGenerator``),
instantiated by the recipe like :class:`~torchtune_grpo.generation.NativeGenerator`.

``GENERATE_CALLS`` counts calls in this process; :class:`tests._losses.StepCyclingLoss` uses it as the step
number (one generation round per step without dynamic sampling).
"""

from typing import List, Mapping, Optional, Sequence

import torch

from torchtune_grpo.generation import GenerationEngine, Rollout

GENERATE_CALLS = 0


class ScriptedGenerator(GenerationEngine):
    """Completions from the prompt's ids: varied lengths, some truncated, some groups all alike.

    Args:
        flat_every (int): when > 0, prompts whose hash is divisible by it get ``group_size`` identical
            completions (a zero-variance group). Default is 0 (never).
        low (int): smallest token id used. Default is 60.
        high (int): one past the largest token id used. Default is 300.
        logprob_center (Optional[float]): when set, the engine reports "sampling logprobs" (as vLLM does)
            ``center + 0.6 * ((37 * token) % 11 / 10 - 0.5)`` per response token, a fixed function of the
            token, so rollout-correction weights differ from 1 but agree across ranks and runs. Default is
            None (no logprobs, as the native engine).
        routes (Optional[List[int]]): ``[num_moe_layers, num_experts, top_k]``: report scripted routed experts
            (``Rollout.routed_experts``, as an engine of a mixture of experts does) for routing replay: at position
            ``p`` holding token ``t``, layer ``l`` gets ``top_k`` distinct experts from ``(7 t + 3 l + p) % E``, a
            fixed function of the token, so they agree across ranks and runs and often differ from the trainer's
            own choice; -1 for the last token (never an input). Default is None (no routes).

    Image prompts (``takes_images``): the completions are the same function of the prompt's ids (which hold the
    image tokens); the images are only checked to come one entry per prompt.
    """

    temperature = 1.0
    takes_images = True

    def __init__(
        self, flat_every: int = 0, low: int = 60, high: int = 300, logprob_center: Optional[float] = None,
        routes: Optional[List[int]] = None,
    ) -> None:
        self.flat_every = flat_every
        self.low, self.high = low, high
        self.logprob_center = logprob_center
        self.routes = None if routes is None else [int(v) for v in routes]

    def generate(
        self,
        model: torch.nn.Module,
        prompts: List[List[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        generator: Optional[torch.Generator] = None,
        temperature: Optional[float] = None,
        images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
    ) -> Rollout:
        global GENERATE_CALLS
        GENERATE_CALLS += 1
        if images is not None:
            if len(images) != len(prompts):
                raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts")
        prompt_ids, response_ids, truncated = [], [], []
        span = self.high - self.low
        for p in prompts:
            h = sum((i + 1) * t for i, t in enumerate(p))
            flat = self.flat_every > 0 and h % self.flat_every == 0
            for j in range(group_size):
                k = 0 if flat else j
                # Lengths 1 .. max_new_tokens + 2; above the budget means truncated (no stop token).
                length = 1 + (h + 5 * k) % (max_new_tokens + 2)
                cut = length > max_new_tokens
                body = [self.low + (h * 7 + k * 13 + t * 31) % span for t in range(min(length, max_new_tokens))]
                if not cut:
                    body[-1] = stop_tokens[0]
                prompt_ids.append(list(p))
                response_ids.append(body)
                truncated.append(cut)
        logprobs = None
        if self.logprob_center is not None:
            c = self.logprob_center
            logprobs = [[c + 0.6 * ((37 * t) % 11 / 10 - 0.5) for t in row] for row in response_ids]
        return Rollout(
            prompt_ids=prompt_ids, response_ids=response_ids, truncated=torch.tensor(truncated), logprobs=logprobs,
            routed_experts=None if self.routes is None else [
                self._scripted_routes(p + r) for p, r in zip(prompt_ids, response_ids)],
        )

    def _scripted_routes(self, ids: List[int]) -> torch.Tensor:
        """``[len(ids), layers, k]`` int16 routes of one row (see ``routes`` in the class docstring)."""
        layers, experts, k = self.routes
        out = torch.full((len(ids), layers, k), -1, dtype=torch.int16)
        for p, t in enumerate(ids[:-1]):
            for layer in range(layers):
                first = (7 * t + 3 * layer + p) % experts
                out[p, layer] = torch.tensor([(first + j) % experts for j in range(k)], dtype=torch.int16)
        return out


class ToolScriptGenerator(GenerationEngine):
    """Multi-turn test engine: even rows of a group call the calculator once, then answer with its result;
    odd rows answer "7" at once. Turns are text encoded with the model directory's ``tokenizer.json`` and
    closed with ``<|im_end|>``; histories are read back as text (the engine sees each episode's history).

    Args:
        tokenizer_dir (str): a directory with ``tokenizer.json`` (tests/chat_templates.make_tokenizer_dir).
    """

    temperature = 1.0

    def __init__(self, tokenizer_dir: str) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
        self.eot = self.tok.token_to_id("<|im_end|>")

    def _turn(self, history: str, j: int) -> str:
        if "<tool_response>" in history:
            return "The answer is " + history.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0] + "."
        if j % 2:
            return "The answer is 7."
        return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'

    def generate(self, model, prompts, *, group_size, max_new_tokens, pad_id, stop_tokens, generator=None,
                 temperature=None) -> Rollout:
        rows, truncated = [], []
        for p in prompts:
            history = self.tok.decode(list(p), skip_special_tokens=False)
            for j in range(group_size):
                ids = self.tok.encode(self._turn(history, j), add_special_tokens=False).ids + [self.eot]
                rows.append(ids[:max_new_tokens])
                truncated.append(len(ids) > max_new_tokens)
        return Rollout(
            prompt_ids=[list(p) for p in prompts for _ in range(group_size)], response_ids=rows,
            truncated=torch.tensor(truncated),
        )
