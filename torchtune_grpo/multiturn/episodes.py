"""Multi-turn episodes: sample a turn, let the environment answer, append its reply, sample again.

:func:`run_episodes` drives ``group_size`` episodes per prompt through any generation engine. Each round
samples one turn for every live episode (one ``engine.generate`` call over all of them), decodes it, steps
the environment for all of them at once (:func:`~torchtune_grpo.multiturn.environment.step_episodes`), and
appends each reply's tokens (:class:`~torchtune_grpo.multiturn.turns.ChatTurns`). An episode ends when the
environment says so, when the model's turn ends with a stop token other than the end-of-turn token, at
``max_turns``, when its token budget runs out, or when the environment fails (error counted, the episode's
reward becomes the fallback later).

The result is one token sequence per episode after its prompt, with an *action mask*: 1 on the tokens the
model sampled (its turns, stop tokens included), 0 on the environment's. Only actions get a loss, KL,
entropy or ratio term and count in any normalisation (docs/multi_turn.md).

An engine that offers a ``session`` (the native engine: :class:`~torchtune_grpo.generation.GenerationSession`)
keeps each episode's KV cache between turns: a later turn prefills only the model's last sampled token and
the environment's reply, then decodes; the history is not recomputed. Other engines get each live
episode's whole history again every turn (vLLM reuses it through prefix caching).

Prompts with images (each prompt's ``image_inputs`` field, docs/multimodal.md) go to the session, whose first turn
prefills with the pixels, or to every ``generate`` call: a re-sent history is text after its prompt's images.
"""

import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from torchtune_grpo.generation import decode_responses
from torchtune_grpo.models import text_after
from torchtune_grpo.multiturn.environment import Environment, start_episodes, step_episodes
from torchtune_grpo.multiturn.turns import episode_turns

__all__ = ["Episodes", "MultiTurn", "run_episodes"]


class Episodes(NamedTuple):
    """``N = num_prompts x group_size`` episodes; row ``i`` belongs to prompt ``i // group_size``.

    Attributes:
        prompt_ids (List[List[int]]): each row's prompt.
        response_ids (List[List[int]]): every token after the prompt: the model's turns and the replies.
        action_mask (List[List[int]]): per response token, 1 if the model sampled it, 0 if injected.
        truncated (torch.Tensor): ``[N]`` bool: the episode ran out of tokens or turns before it ended.
        logprobs (Optional[List[List[float]]]): the engine's logprob per response token (0.0 on injected
            tokens); None when the engine samples with the trainer's model.
        messages (List[List[Dict[str, Any]]]): the episode after the prompt, as chat messages (the model's
            turns as ``assistant``, the environment's replies with their roles).
        turns (List[int]): model turns per episode.
        env_errors (List[str]): ``""``, or why the environment ended the episode (exception or timeout).
        info (List[Dict[str, float]]): the environment's step infos, summed per episode (tool calls...).
        env_seconds (float): wall-clock seconds spent waiting for the environment (all episodes).
    """

    prompt_ids: List[List[int]]
    response_ids: List[List[int]]
    action_mask: List[List[int]]
    truncated: torch.Tensor
    logprobs: Optional[List[List[float]]]
    messages: List[List[Dict[str, Any]]]
    turns: List[int]
    env_errors: List[str]
    info: List[Dict[str, float]]
    env_seconds: float = 0.0

    def final_answers(self) -> List[str]:
        """The text of each episode's last model turn (what single-turn rewards score)."""
        return [next((m["content"] for m in reversed(ms) if m["role"] == "assistant"), "") for ms in self.messages]


class _Episode:
    """One episode's growing state (internal to :func:`run_episodes`)."""

    def __init__(self, prompt: List[int], fields: Dict[str, Any], budget: int) -> None:
        self.prompt, self.fields, self.budget = prompt, fields, budget
        self.ids: List[int] = []
        self.mask: List[int] = []
        self.logprobs: List[float] = []
        self.messages: List[Dict[str, Any]] = []
        self.turns, self.error, self.truncated, self.done = 0, "", False, False
        self.info: Dict[str, float] = {}
        self.state: Any = None

    @property
    def left(self) -> int:
        return self.budget - len(self.ids)

    def add(self, ids: Sequence[int], action: bool, logprobs: Optional[Sequence[float]] = None) -> None:
        self.ids += list(ids)
        self.mask += [int(action)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


def run_episodes(
    engine,
    model: nn.Module,
    prompts: List[List[int]],
    fields: List[Dict[str, Any]],
    *,
    env: Environment,
    turns,
    tokenizer,
    group_size: int,
    max_new_tokens: int,
    max_turns: int,
    env_timeout: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    temperature: Optional[float] = None,
) -> Episodes:
    """Run ``group_size`` episodes for each prompt (see the module docstring).

    Args:
        engine: a generation engine (:class:`~torchtune_grpo.generation.GenerationEngine`).
        model (nn.Module): the policy (ignored by engines with their own weights).
        prompts (List[List[int]]): prompt ids, one per prompt (rendered with the tools by the chat template).
        fields (List[Dict[str, Any]]): each prompt's dataset columns, passed to ``env.start``.
        env (Environment): the environment.
        turns: :class:`~torchtune_grpo.multiturn.turns.ChatTurns` or ``PlainTurns`` (replies as ids).
        tokenizer: ``decode``, ``pad_id``, ``stop_tokens`` and ``eot_id`` (None: any stop token ends a turn).
        group_size (int): episodes per prompt.
        max_new_tokens (int): the token budget of an episode after its prompt (turns and replies).
        max_turns (int): model turns per episode at most.
        env_timeout (Optional[float]): seconds per environment call. Default is None (no limit).
        generator (Optional[torch.Generator]): sampling RNG. Default is None.
        temperature (Optional[float]): overrides the engine's temperature. Default is None.

    Returns:
        Episodes: the episodes, row ``i`` of prompt ``i // group_size``.
    """
    if max_turns < 1 or max_new_tokens < 1:
        raise ValueError(f"max_turns and max_new_tokens must be >= 1, got {max_turns} and {max_new_tokens}")
    episodes = [_Episode(list(p), f, max_new_tokens) for p, f in zip(prompts, fields) for _ in range(group_size)]
    t0 = time.perf_counter()
    started = start_episodes(env, [ep.fields for ep in episodes], env_timeout)
    env_seconds = time.perf_counter() - t0
    for ep, outcome in zip(episodes, started):
        ep.state, ep.error, ep.done = outcome.value, outcome.error, bool(outcome.error)
    kwargs = {} if temperature is None else {"temperature": temperature}
    # Each prompt's image inputs (image_dataset's field), passed only when a prompt has some: engines that take no
    # images have no such argument.
    images = [f.get("image_inputs") for f in fields]
    images = images if any(i is not None for i in images) else None
    open_session = getattr(engine, "session", None)  # optional (GenerationEngine.session)
    session = None if open_session is None else open_session(
        model, [list(p) for p in prompts], group_size=group_size, max_new_tokens=max_new_tokens,
        pad_id=tokenizer.pad_id, stop_tokens=tokenizer.stop_tokens, **({} if images is None else {"images": images}),
    )
    try:
        seconds, engine_logprobs = _run_turns(
            engine, session, model, prompts, episodes, env, turns, tokenizer, group_size, max_turns, env_timeout,
            dict(generator=generator, **kwargs), images,
        )
    finally:
        if session is not None:
            session.close()
    env_seconds += seconds
    return Episodes(
        prompt_ids=[ep.prompt for ep in episodes],
        response_ids=[ep.ids for ep in episodes],
        action_mask=[ep.mask for ep in episodes],
        truncated=torch.tensor([ep.truncated for ep in episodes], dtype=torch.bool),
        logprobs=[ep.logprobs for ep in episodes] if engine_logprobs else None,
        messages=[ep.messages for ep in episodes],
        turns=[ep.turns for ep in episodes],
        env_errors=[ep.error for ep in episodes],
        info=[ep.info for ep in episodes],
        env_seconds=env_seconds,
    )


def _run_turns(
    engine, session, model, prompts, episodes, env, turns, tokenizer, group_size, max_turns, env_timeout, sampling,
    images=None,
) -> Tuple[float, bool]:
    """Sample, step the environment, append its replies, until no episode is live (``episodes`` grow in
    place). Returns the seconds spent in the environment and whether the engine gave logprobs.

    ``images``: each prompt's image inputs (or None). Without a session every turn re-sends them with the row's
    history: the engine prefills prompt and history with the pixels (the history is text after the prompt)."""
    eot = getattr(tokenizer, "eot_id", None)
    stops = set(tokenizer.stop_tokens)
    first, env_seconds, engine_logprobs = True, 0.0, False
    while True:
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not live:
            return env_seconds, engine_logprobs
        # The first turn samples the groups from their shared prompts; later turns continue each history.
        rows = list(range(len(episodes))) if first else live
        budget = max(episodes[i].left for i in live)
        if session is not None:
            rollout = session.generate(rows, [episodes[i].ids for i in rows], max_new_tokens=budget, **sampling)
        else:
            extra = {}
            if images is not None:
                extra["images"] = images if first else [
                    text_after(images[i // group_size], len(episodes[i].ids)) for i in live]
            rollout = engine.generate(
                model,
                [list(p) for p in prompts] if first else [episodes[i].prompt + episodes[i].ids for i in live],
                group_size=group_size if first else 1,
                max_new_tokens=budget,
                pad_id=tokenizer.pad_id,
                stop_tokens=tokenizer.stop_tokens,
                **sampling,
                **extra,
            )
        rows = [episodes[i] for i in rows]
        first, engine_logprobs = False, rollout.logprobs is not None
        for k, ep in enumerate(rows):
            if ep.done:  # an episode whose start failed still took part in the grouped first call
                continue
            turn = list(rollout.response_ids[k])[: ep.left]
            lps = rollout.logprobs[k][: len(turn)] if rollout.logprobs is not None else None
            ep.add(turn, action=True, logprobs=lps)
            ep.turns += 1
            # decode_responses: an id the tokenizer cannot decode (a diverging policy) drops out of the text
            text = decode_responses(tokenizer, [[t for t in turn if t not in stops]])[0]
            ep.messages.append({"role": "assistant", "content": text})
            if not turn or turn[-1] not in stops:
                ep.truncated = ep.done = True  # out of tokens mid-turn
            elif eot is not None and turn[-1] != eot:
                ep.done = True  # end of text, not end of turn: the model ended the conversation
        live = [ep for ep in rows if not ep.done]
        t0 = time.perf_counter()
        outcomes = step_episodes(env, [ep.state for ep in live], [ep.messages[-1] for ep in live], env_timeout)
        env_seconds += time.perf_counter() - t0
        for ep, outcome in zip(live, outcomes):
            if outcome.error:
                ep.error, ep.done = outcome.error, True
                continue
            reply = outcome.value
            for key, value in reply.info.items():
                if isinstance(value, (int, float)):
                    ep.info[key] = ep.info.get(key, 0.0) + float(value)
            if reply.done:
                ep.done = True
                continue
            if ep.turns >= max_turns:
                ep.truncated = ep.done = True  # the model still wanted to act
                continue
            ids = turns.reply_ids(reply.messages)
            if len(ids) >= ep.left:  # no room for the reply and at least one model token
                ep.truncated = ep.done = True
                continue
            ep.add(ids, action=False)
            ep.messages += list(reply.messages)


class MultiTurn:
    """A run's multi-turn settings: the environment and the limits of an episode.

    Args:
        environment (Environment): the environment (a ``_component_``).
        max_turns (int): model turns per episode at most. Default is 4.
        env_timeout (Optional[float]): seconds per environment call. Default is 30.0.

    Raises:
        ValueError: when ``max_turns`` < 1 or ``env_timeout`` <= 0.
    """

    def __init__(self, environment: Environment, max_turns: int = 4, env_timeout: Optional[float] = 30.0) -> None:
        if int(max_turns) < 1:
            raise ValueError(f"multi_turn.max_turns must be >= 1, got {max_turns}")
        if env_timeout is not None and not float(env_timeout) > 0:
            raise ValueError(f"multi_turn.env_timeout must be > 0 seconds (or null), got {env_timeout}")
        self.environment = environment
        self.max_turns = int(max_turns)
        self.env_timeout = None if env_timeout is None else float(env_timeout)
        self._turns: Dict[int, Any] = {}

    @property
    def tools(self) -> Optional[List[Dict[str, Any]]]:
        """The environment's tool schemas (its ``tools`` attribute), for rendering into prompts; None."""
        return getattr(self.environment, "tools", None)

    def attach(self, tokenizer) -> Optional[str]:
        """Prepare ``tokenizer`` for these episodes, before any dataset tokenizes its prompts: the environment's
        tool schemas go into its ``tools`` (rendered by its chat template into every prompt), and the way
        replies are rendered is chosen now, so a chat template that cannot be continued fails at setup.

        Returns:
            Optional[str]: a note to log when the environment has tools the tokenizer cannot render, else None.
        """
        note = None
        if self.tools and not hasattr(tokenizer, "tools"):
            note = (f"{type(tokenizer).__name__} cannot render tool schemas: prompts do not list the environment's "
                    "tools (use torchtune_grpo.models.hf_tokenizer for a model directory's chat template)")
        elif self.tools:
            tokenizer.tools = self.tools
        self.turns_for(tokenizer)
        return note

    def turns_for(self, tokenizer) -> Any:
        """:class:`ChatTurns` for a tokenizer with a chat template and end-of-turn token, else :class:`PlainTurns`."""
        key = id(tokenizer)
        if key not in self._turns:
            self._turns[key] = episode_turns(tokenizer, self.tools)
        return self._turns[key]

    def run(self, engine, model: nn.Module, tokenizer, prompts: List[List[int]], fields: List[Dict[str, Any]], *,
            group_size: int, max_new_tokens: int, generator: Optional[torch.Generator] = None,
            temperature: Optional[float] = None) -> Episodes:
        """:func:`run_episodes` with these settings."""
        return run_episodes(
            engine, model, prompts, fields, env=self.environment, turns=self.turns_for(tokenizer),
            tokenizer=tokenizer, group_size=group_size, max_new_tokens=max_new_tokens, max_turns=self.max_turns,
            env_timeout=self.env_timeout, generator=generator, temperature=temperature,
        )
