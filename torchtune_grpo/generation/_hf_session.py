"""Multi-turn sessions of the native engine on transformers' own modules: each row's cache kept between turns.

The torchtune backend's session (``_session.py``) writes every row's tokens at its own positions of a static
cache. transformers' dynamic cache is one rectangle ``[rows, heads, slots, dim]`` per layer, every row the
same number of slots, so a row's history is kept with *holes*: slots its attention mask marks 0. A later turn
appends, for every row it continues, what the row's cache does not hold yet (the last token the model sampled,
never fed back, and the environment's reply), right-aligned in one ``[n, M]`` forward (the columns left of a
shorter append are holes), with the row's own position ids (prompt length + index in the history); then it
decodes. Slots a row wrote past its stop token (padding fed while other rows decoded) become holes after the
turn. Softmax attention over a row's unmasked slots with explicit positions is then the same function as over
its history re-sent in one piece.

Which families:

- full attention in every layer (``DynamicLayer``: Llama, Qwen3, Phi-3, SmolLM3, Ministral 3, Qwen3-MoE, OLMoE,
  Mixtral without a window, ...): transformers' own masks (a 2-D mask with the holes);
- sliding windows (Gemma 3/4, OLMo 3, gpt-oss, Mistral with its window, Qwen2.5's windowed layers): transformers'
  sliding cache keeps the last ``window - 1`` *slots* and its masks count slots, so holes would push real tokens
  out of the window. Here every windowed layer keeps all its slots instead, and after the first prefill each
  forward gets explicit masks by *position* (causal and windowed by position id, holes masked; the training
  layouts' per-family mask rule, ``models/_transformers_layouts.py``), so a window spans the last ``w`` positions
  of the row's history whatever slots they sit in;
- not linear attention (Qwen3.5's Gated DeltaNet): its state is a running sum that cannot skip a hole (a hole's
  zeroed input still decays the state).

For those :func:`hf_session_unsupported` says why and the engine gives no session: each turn re-sends the
row's history (prefilled once per turn, then decoded as a one-shot rollout).

Rows and batches: the first turn samples every row (prompts prefilled once per group); no row leaves the batch
during a turn (a row whose turn stopped keeps its cache for the next one, and transformers' cache has no way to
set rows aside and put them back), so ``compact_decode`` does not apply within a session's turns. A later turn
runs only the rows it continues: the others are dropped from the cache for good (a multi-turn episode that
ended never continues), and continuing a dropped row is an error. A mixture of experts' routes are not recorded
in a session (multi-turn episodes carry none).

Images in the prompt: the first turn's prefill runs the image-text class's inner model with the pixels
(:class:`~torchtune_grpo.generation._hf_rollout.HFRollout`, as a one-shot rollout); later turns append text on the
kept cache through the causal LM, Qwen3.5's M-RoPE offset of each row applied to the appended positions as to
decode steps. (The image families as shipped have sliding windows or linear attention, so they get no session and
re-send the history with the pixels every turn; this serves a full-attention image model.)
"""

from typing import Any, List, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_grpo.generation._decode import to_rollout
from torchtune_grpo.generation._hf_rollout import HFRollout
from torchtune_grpo.generation._output import Rollout
from torchtune_grpo.generation._session import SessionRows
from torchtune_grpo.models import grouped_kv_attention

__all__ = ["HFSession", "hf_session_unsupported"]


def _other_layers(layers: List[Any], windows: bool = False) -> List[str]:
    """The class names of cache layers that are not plain full attention (``DynamicLayer``; with ``windows``, nor
    transformers' sliding-window layer)."""
    from transformers import DynamicLayer

    from torchtune_grpo.generation._hf_cache import GrowingLayer, is_window_layer

    return sorted({type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, GrowingLayer)
                   and not (windows and is_window_layer(layer))})


def _own_cache_layers(hf: nn.Module) -> List[Any]:
    """The cache layers ``hf``'s own forward would build (transformers' ``DynamicCache`` for its config)."""
    from transformers import DynamicCache

    return DynamicCache(config=hf.config).layers


def has_windows(hf: nn.Module) -> bool:
    """Whether ``hf``'s own cache has sliding-window layers (its session then attends by position)."""
    from torchtune_grpo.generation._hf_cache import is_window_layer

    return any(is_window_layer(layer) for layer in _own_cache_layers(hf))


def hf_session_unsupported(hf: nn.Module) -> Optional[str]:
    """Why ``hf``'s cache cannot be kept between turns (see the module docstring), or None when it can."""
    from torchtune_grpo.generation._hf_cache import is_window_layer
    from torchtune_grpo.models._transformers_layouts import config_unsupported

    layers = _own_cache_layers(hf)
    kinds = _other_layers(layers, windows=True)
    if kinds:
        return (f"{type(hf).__name__}'s cache has {', '.join(kinds)} layers (linear attention cannot keep a history "
                "with holes): each turn re-sends the history")
    if any(is_window_layer(layer) for layer in layers):
        reason = config_unsupported(hf.config)
        if reason is not None:
            return f"its windowed layers need masks by position, and {reason}: each turn re-sends the history"
    return None


class HFSession(SessionRows):
    """A native engine's multi-turn session over ``N = B x G`` rows of a transformers policy.

    The same contract as :class:`~torchtune_grpo.generation._session.NativeSession` (``generate`` once per turn,
    ``close``), for the families :func:`hf_session_unsupported` accepts.

    Args:
        engine (Any): the :class:`~torchtune_grpo.generation.NativeGenerator` (its ``temperature``,
            ``share_prefill`` and ``decode_loop``).
        hf (nn.Module): the transformers causal LM (``TransformersDecoder.sampler()``).
        prompts (List[List[int]]): ``B`` prompts.
        group_size (int): rows per prompt, ``G``.
        max_new_tokens (int): each row's budget after its prompt over all turns.
        pad_id (int): padding id.
        stop_tokens (Sequence[int]): ids that end a turn.
        image_model (Optional[nn.Module]): the policy's image side (:func:`~torchtune_grpo.models.attach_images`),
            needed with ``images``. Default is None.
        images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs, or None:
            the first turn's prefill runs with the pixels (as a one-shot rollout's), later turns are text on the
            kept cache (Qwen3.5's M-RoPE offset of each row kept with it). Default is None.

    Raises:
        ValueError: when ``max_new_tokens`` < 1 or a prompt is empty.
    """

    def __init__(self, engine: Any, hf: nn.Module, prompts: List[List[int]], group_size: int, max_new_tokens: int,
                 pad_id: int, stop_tokens: Sequence[int], *, image_model: Optional[nn.Module] = None,
                 images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None) -> None:
        super().__init__(engine, prompts, group_size, max_new_tokens, pad_id, stop_tokens)
        self.hf = hf
        self.image_model, self.images = image_model, images
        # Per row, the cache slot of each history token that has keys and values there (a prefix of the history).
        self.slots: List[List[int]] = [[] for _ in range(self.n)]
        self.kept: List[int] = []  # the session rows in the cache, in its batch order

    def generate(self, rows: Sequence[int], responses: Sequence[Sequence[int]], *, max_new_tokens: int,
                 generator: Optional[torch.Generator] = None, temperature: Optional[float] = None) -> Rollout:
        """Sample the next turn of ``rows``, whose tokens after the prompt are now ``responses``.

        Args:
            rows (Sequence[int]): the rows to sample (distinct, in ``[0, N)``); the first call: all, in order.
            responses (Sequence[Sequence[int]]): each row's tokens after its prompt (the first call: empty).
            max_new_tokens (int): tokens to sample at most this turn (each row also stops at the session's budget).
            generator (Optional[torch.Generator]): sampling RNG. Default is None.
            temperature (Optional[float]): overrides the engine's temperature. Default is None.

        Returns:
            Rollout: one row per entry of ``rows``, in that order; ``prompt_ids`` are prompt + response.

        Raises:
            ValueError: naming the row, when rows are out of range or repeated, the first call is not over every
                row, a later response is empty or leaves no room in the budget, or a row left out of an earlier
                turn is continued.
            RuntimeError: after :meth:`close`.
        """
        rows, responses = self._turn(rows, responses)
        temperature = self.engine.temperature if temperature is None else temperature
        with torch.inference_mode(), grouped_kv_attention(self.hf):
            if self._run is None:
                return self._first_turn(rows, responses, max_new_tokens, generator, temperature)
            return self._next_turn(rows, responses, max_new_tokens, generator, temperature)

    def _decode(self, logits: torch.Tensor, max_new_tokens: int, generator, temperature,
                room: Optional[torch.Tensor]) -> "tuple[torch.Tensor, torch.Tensor, int]":
        """The engine's plain decode loop on the session's batch; also the slot of the turn's first decoded token."""
        run = self._run
        first_slot = run.slots
        stop = torch.tensor(self.stop_tokens, dtype=torch.long, device=run.device)
        out, stopped = self.engine.decode_loop(logits, run.decode, max_new_tokens, self.pad_id, stop, temperature,
                                               generator, room=room)
        return out, stopped, first_slot

    def _keep_fed(self, rows: List[int], ids: List[List[int]], first_slot: int) -> None:
        """After a turn: each row's sampled tokens but the last (fed at ``first_slot + t``) join its cached history;
        every slot after them becomes a hole."""
        run = self._run
        mask = run.full_mask()
        for j, (i, new) in enumerate(zip(rows, ids)):
            fed = max(len(new) - 1, 0)  # the last sampled token is never fed back
            self.slots[i] += list(range(first_slot, first_slot + fed))
            mask[j, first_slot + fed:] = 0
            self.history[i] += new

    def _first_turn(self, rows, responses, max_new_tokens, generator, temperature) -> Rollout:
        run = self._run = HFRollout(self.hf, self.prompt_groups, self.group_size, self.pad_id,
                                    share_prefill=self.engine.share_prefill, image_model=self.image_model,
                                    images=self.images, by_position=has_windows(self.hf))
        logits = run.prefill()
        other = _other_layers(run.cache.layers)
        if other:  # the model built another cache than its config said: never guess
            raise RuntimeError(f"{type(self.hf).__name__} built a cache with {', '.join(other)} layers: a session "
                               "cannot keep it between turns")
        out, stopped, first_slot = self._decode(logits, min(max_new_tokens, self.budget), generator, temperature, None)
        stop = torch.tensor(self.stop_tokens, dtype=torch.long, device=run.device)
        rollout = to_rollout([list(p) for p in self.prompts], out, stopped, stop)
        self.kept = list(rows)
        self._keep_fed(rows, rollout.response_ids, first_slot)
        return rollout

    def _next_turn(self, rows, responses, max_new_tokens, generator, temperature) -> Rollout:
        run, device = self._run, self._run.device
        dropped = [i for i in rows if i not in self.kept]
        if dropped:
            raise ValueError(f"rows {dropped} were left out of an earlier turn: their caches are gone (a session "
                             "continues the rows of live episodes only)")
        for i, resp in zip(rows, responses):
            if not resp:
                raise ValueError(f"row {i}: an empty response cannot be continued (the first turn samples it)")
            if len(resp) >= self.budget:
                raise ValueError(f"row {i}: {len(resp)} tokens leave no room in the session's budget of {self.budget}")
        if rows != self.kept:  # the turn's rows alone, in its order (the others' episodes ended)
            at = {i: j for j, i in enumerate(self.kept)}
            run.select(torch.tensor([at[i] for i in rows], dtype=torch.long, device=device))
            self.kept = list(rows)
        mask = run.full_mask()
        appends = []
        for j, (i, resp) in enumerate(zip(rows, responses)):
            known, reuse = self.history[i], 0
            limit = min(len(self.slots[i]), len(resp) - 1)  # at least one token is fed: its logits start the turn
            while reuse < limit and resp[reuse] == known[reuse]:
                reuse += 1
            mask[j, self.slots[i][reuse:]] = 0  # cached tokens the response no longer has: holes
            del self.slots[i][reuse:]
            self.history[i] = resp[:reuse]
            appends.append(resp[reuse:])
        width = max(len(new) for new in appends)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [n, M]
        valid = torch.zeros((len(rows), width), dtype=torch.long)  # [n, M]
        positions = torch.zeros((len(rows), width), dtype=torch.long)  # [n, M]
        for j, (i, new) in enumerate(zip(rows, appends)):
            start = len(self.prompts[i]) + len(self.history[i])  # the position of the row's first new token
            ids[j, width - len(new):] = torch.tensor(new, dtype=torch.long)
            valid[j, width - len(new):] = 1
            positions[j, width - len(new):] = torch.arange(start, start + len(new))
            self.slots[i] += list(range(run.slots + width - len(new), run.slots + width))
            self.history[i] += new
        logits = run.append(ids.to(device), valid.to(device), positions.to(device))  # [n, V]
        room = torch.tensor([self.budget - len(r) for r in responses], dtype=torch.long, device=device)
        out, stopped, first_slot = self._decode(logits, max_new_tokens, generator, temperature, room)
        stop = torch.tensor(self.stop_tokens, dtype=torch.long, device=device)
        rollout = to_rollout([self.prompts[i] + r for i, r in zip(rows, responses)], out, stopped, stop)
        new_ids = [ids_[: self.budget - len(r)] for ids_, r in zip(rollout.response_ids, responses)]  # budget's cut
        self._keep_fed(rows, new_ids, first_slot)
        return rollout._replace(response_ids=new_ids)
