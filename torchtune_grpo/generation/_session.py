"""Multi-turn sessions of the native engine: each row's KV cache kept from one turn to the next.

A multi-turn episode grows by a model turn, then an environment reply, then another model turn. Re-sending
the whole history every turn recomputes the prompt and every earlier turn. A :class:`NativeSession` keeps
the rollout's static cache (either layout of ``_rollout_caches.py``) for the session's length and, per row, which
of its response tokens already have keys and values there. A later turn prefills only what a row does not
have yet: the last token the model sampled (sampled, never fed back) and the environment's reply; then it
decodes from there.

Rows hold histories of different lengths, so every row keeps its own write position: completion index
``c`` of a row always holds its response token ``c`` (the turn-one decode writes token ``t`` of every row
at ``c = t``; later turns write at ``c = len(history) + t``), its position id is its prompt length plus
``c``, and its query at ``c`` sees its prompt and its completion slots ``<= c``. A row's tokens therefore
sit right after its own real tokens, never after another row's padding; slots a row wrote past its end in
an earlier turn (the pads decoded after its stop token) are overwritten before it reads them.

The appended tokens of a turn form one ``[N, M]`` forward (``M``: the longest append), each row's tokens
right-aligned so the last column is every appending row's last token (its logits start the turn). The
columns left of a shorter append, and every slot a row writes beyond its budget, go to one scratch slot,
completion index ``max_new_tokens - 1``: no real token ever lands there (a row's history leaves room for
one sampled token, and the last sampled token is never fed), and no real query sees it.

With the engine's ``compact_decode`` (the default) the decode batch follows the rows still generating
(:class:`RowViews`). A later turn that continues only some rows (the others' episodes ended) runs on those
rows alone: their caches are copied into a turn-sized batch (whole groups keep sharing their prompt; a
group's surviving rows each get a copy of it) and copied back after the turn. Within any turn, first or
later, rows that stop leave the batch at the stop checks as in a one-shot rollout's compacting decode
(``_compact.py``), except that their caches are first written back to the session's storage, since a
later turn may continue them. Each compaction costs about two decode steps' worth of memory traffic,
instead of the stopped rows' share of every decode step after it. A seeded generator draws the same noise
either way (one uniform per sampled row). Compiled decoding (CUDA graphs, specialised on the batch size)
and ``compact_decode: false`` keep every row in the batch, the ended ones fed padding and not sampled from.
"""

from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import nn

from torchtune_grpo.generation._cache import attached_caches, attention_modules
from torchtune_grpo.generation._decode import can_skip_module_hooks, to_rollout
from torchtune_grpo.generation._rollout_caches import PerRowRollout, SharedPrefixRollout
from torchtune_grpo.generation._output import Rollout
from torchtune_grpo.models.logprobs import replace_unembed


class SessionEngine(Protocol):
    """What a session uses of its engine (:class:`~torchtune_grpo.generation.NativeGenerator`, which imports
    this module): its sampling settings, its cache pool and the public steps of a rollout."""

    temperature: float
    compact_decode: bool
    reuse_cache: bool
    cache: Any

    def unembed_for(self, model: nn.Module) -> Any: ...

    def new_rollout(self, model: nn.Module, attns: List[nn.Module], prompts: List[List[int]], group_size: int,
                    max_new_tokens: int, pad_id: int) -> Any: ...

    def first_turn(self, model: nn.Module, attns: List[nn.Module], run: Any, max_new_tokens: int, pad_id: int,
                   stop: torch.Tensor, temperature: float, generator: Optional[torch.Generator],
                   compact: bool = False, views: Optional["RowViews"] = None) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def compacting_loop(self, logits: torch.Tensor, feed: Callable[[torch.Tensor, int], torch.Tensor],
                        compact: Callable[[torch.Tensor], None], max_new_tokens: int, pad_id: int,
                        stop: torch.Tensor, temperature: float, generator: Optional[torch.Generator],
                        room: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def decode_loop(self, logits: torch.Tensor, feed: Callable[[torch.Tensor, int], torch.Tensor],
                    max_new_tokens: int, pad_id: int, stop: torch.Tensor, temperature: float,
                    generator: Optional[torch.Generator], rows: Optional[torch.Tensor] = None,
                    room: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def session_closed(self, session: "NativeSession") -> None: ...

__all__ = ["NativeSession", "RowViews"]


class RowViews:
    """A session turn's decode batch: rows of the session's caches, shrunk as rows stop.

    It starts as the session's rollout itself (``copy`` False: every row, in order) or as a copy of some
    rows (:meth:`~torchtune_grpo.generation._rollout_caches.SharedPrefixRollout.select_rows`). :meth:`compact` is
    the compacting decode loop's callback: it writes the current copy's completion caches back to the
    session's storage, copies the kept rows out again and attaches their caches in place of the old ones.
    So stopped rows keep their caches for a later turn while the decode batch holds the live rows only.

    Args:
        run (Union[SharedPrefixRollout, PerRowRollout]): the session's rollout (eager).
        attns (List[nn.Module]): the model's attention modules, inside ``attached_caches``.
        rows (torch.Tensor): ``[n]`` the session rows of the turn's batch, in the turn's order.
        copy (bool): start from a copy of ``rows`` (else the rollout itself; ``rows`` is then
            ``0 .. N-1``).
        caches (str): the rollout attribute of the caches the turn decodes with: ``"decode_caches"``
            (the first turn) or ``"row_decode_caches"`` (later turns).
        per_row (Optional[Dict[str, torch.Tensor]]): ``[n]`` tensors kept in step with the batch (a later
            turn's write positions). Default is None.
    """

    def __init__(
        self,
        run: Union[SharedPrefixRollout, PerRowRollout],
        attns: List[nn.Module],
        rows: torch.Tensor,
        copy: bool,
        caches: str,
        per_row: Optional[Dict[str, torch.Tensor]] = None,
    ) -> None:
        self.run, self.attns, self.rows, self.caches = run, attns, rows, caches
        self.current = run.select_rows(rows) if copy else run
        self.per_row = dict(per_row or {})

    def compact(self, keep: torch.Tensor) -> None:
        """Keep batch rows ``keep`` (``[n']`` long, ascending indices into the current batch)."""
        self.write_back()
        self.rows = self.rows.index_select(0, keep)
        self.current = self.run.select_rows(self.rows)
        for attn, cache in zip(self.attns, getattr(self.current, self.caches)):
            attn.kv_cache = cache  # attached_caches restores every module's own cache when the turn ends
        self.per_row = {k: v.index_select(0, keep) for k, v in self.per_row.items()}

    def write_back(self) -> None:
        """Copy the current batch's completion caches to the session's storage (a copy's rows only)."""
        if self.current is not self.run:
            self.run.write_rows(self.current, self.rows)


class SessionRows:
    """What every multi-turn session of the native engine holds: its ``N = B x G`` rows (each row's prompt and
    the response tokens so far), its budget and stop tokens, and whether it is open. A context manager: leaving
    the block closes it. :class:`NativeSession` (torchtune decoders) and
    :class:`~torchtune_grpo.generation._hf_session.HFSession` (transformers' modules) add the cache.

    Args:
        engine (Any): the :class:`NativeGenerator`.
        prompts (List[List[int]]): B prompts.
        group_size (int): rows per prompt, G.
        max_new_tokens (int): each row's budget after its prompt over all turns.
        pad_id (int): padding id.
        stop_tokens (Sequence[int]): ids that end a turn.

    Raises:
        ValueError: when ``max_new_tokens`` < 1 or a prompt is empty.
    """

    def __init__(self, engine: Any, prompts: List[List[int]], group_size: int, max_new_tokens: int, pad_id: int,
                 stop_tokens: Sequence[int]) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"a session's max_new_tokens must be >= 1, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError(f"prompt {next(i for i, p in enumerate(prompts) if not p)} is empty")
        self.engine = engine
        self.prompts = [list(p) for p in prompts for _ in range(group_size)]  # per row
        self.prompt_groups, self.group_size = [list(p) for p in prompts], group_size
        self.budget, self.pad_id, self.stop_tokens = max_new_tokens, pad_id, list(stop_tokens)
        self.n = len(self.prompts)
        self.history: List[List[int]] = [[] for _ in range(self.n)]  # each row's response tokens so far
        self._run: Any = None  # the session's rollout (its cache), from the first turn on
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the session and drop its rollout (subclasses free their cache here too)."""
        self._closed = True
        self._run = None

    def _turn(self, rows: Sequence[int], responses: Sequence[Sequence[int]]) -> Tuple[List[int], List[List[int]]]:
        """``rows`` and ``responses`` of a ``generate`` call as lists, checked: the session open, the rows distinct
        indices in ``[0, N)`` with one response each, and a first turn over every row in order from its prompt."""
        if self._closed:
            raise RuntimeError("this generation session is closed")
        rows, responses = [int(i) for i in rows], [list(r) for r in responses]
        if len(rows) != len(responses) or len(set(rows)) != len(rows) or not all(0 <= i < self.n for i in rows):
            raise ValueError(f"rows must be distinct indices in [0, {self.n}) with one response each, got {rows}")
        if self._run is None and (rows != list(range(self.n)) or any(responses)):
            raise ValueError(
                "the first turn of a session samples every row from its prompt: rows must be 0 .. "
                f"{self.n - 1} in order, with empty responses"
            )
        return rows, responses


class NativeSession(SessionRows):
    """A native engine's multi-turn session over ``N = B x G`` rows (:meth:`NativeGenerator.session`).

    Args:
        engine (SessionEngine): the engine, a :class:`NativeGenerator` (its sampling settings, cache pool and rollout steps).
        model (nn.Module): the torchtune decoder; with FSDP2 unsharded for the whole session.
        prompts (List[List[int]]): B prompts.
        group_size (int): rows per prompt, G.
        max_new_tokens (int): each row's budget after its prompt over all turns; the cache holds
            ``max_new_tokens`` completion slots per row.
        pad_id (int): padding id.
        stop_tokens (Sequence[int]): ids that end a turn.

    Raises:
        ValueError: when ``max_new_tokens`` < 1 or a prompt is empty.
    """

    def __init__(
        self,
        engine: SessionEngine,
        model: nn.Module,
        prompts: List[List[int]],
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
    ) -> None:
        super().__init__(engine, prompts, group_size, max_new_tokens, pad_id, stop_tokens)
        self.model = model
        self.cached = [0] * self.n  # how many leading history tokens have keys/values in the cache

    def close(self) -> None:
        """End the session (the engine frees the cache here unless it ``reuse_cache``)."""
        super().close()
        self.engine.session_closed(self)
        if not self.engine.reuse_cache:
            self.engine.cache.release()

    def generate(
        self,
        rows: Sequence[int],
        responses: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        generator: Optional[torch.Generator] = None,
        temperature: Optional[float] = None,
    ) -> Rollout:
        """Sample the next turn of ``rows``, whose tokens after the prompt are now ``responses``.

        The first call samples every row from its prompt (``rows`` all of ``0 .. N-1``, every response
        empty), as :meth:`NativeGenerator.generate` with ``group_size``. A later call continues any rows:
        each response must extend what the session returned for that row (the row's history and the tokens
        appended since); the longest prefix already in the cache is reused and only the rest is prefilled.

        Args:
            rows (Sequence[int]): the rows to sample (distinct, in ``[0, N)``).
            responses (Sequence[Sequence[int]]): each row's tokens after its prompt.
            max_new_tokens (int): tokens to sample at most this turn (each row also stops at the session's
                budget: ``len(response) +`` its new tokens ``<= max_new_tokens`` of the session).
            generator (Optional[torch.Generator]): sampling RNG. Default is None.
            temperature (Optional[float]): overrides the engine's temperature. Default is None.

        Returns:
            Rollout: one row per entry of ``rows``, in that order; ``prompt_ids`` are prompt + response.

        Raises:
            ValueError: naming the row, when a row is out of range or repeated, a response is empty (after the
                first turn) or leaves no room in the budget, or the first call is not over every row.
            RuntimeError: after :meth:`close`.
        """
        rows, responses = self._turn(rows, responses)
        engine = self.engine
        temperature = engine.temperature if temperature is None else temperature
        with torch.inference_mode(), replace_unembed(self.model, engine.unembed_for(self.model)):
            if self._run is None:
                return self._first_turn(rows, responses, max_new_tokens, generator, temperature)
            return self._next_turn(rows, responses, max_new_tokens, generator, temperature)

    def _first_turn(self, rows, responses, max_new_tokens, generator, temperature) -> Rollout:
        engine, model = self.engine, self.model
        attns = attention_modules(model)
        # Sized once from the whole budget: later turns never outgrow it.
        run = engine.new_rollout(model, attns, self.prompt_groups, self.group_size, self.budget, self.pad_id)
        self._run, self._attns = run, attns
        stop = torch.tensor(self.stop_tokens, dtype=torch.long, device=run.prompt.device)
        views = None
        if engine.compact_decode and not run.compiled:
            views = RowViews(run, attns, torch.arange(self.n, device=run.prompt.device), False, "decode_caches")
        out, stopped = engine.first_turn(
            model, attns, run, min(max_new_tokens, self.budget), self.pad_id, stop, temperature, generator,
            views=views,
        )
        if views is not None:
            views.write_back()
        rollout = to_rollout([list(p) for p in self.prompts], out, stopped, stop)
        for i, ids in enumerate(rollout.response_ids):
            # Token t of every row was fed at completion index t; the last one sampled never was.
            self.history[i], self.cached[i] = list(ids), max(len(ids) - 1, 0)
        return rollout

    def _next_turn(self, rows, responses, max_new_tokens, generator, temperature) -> Rollout:
        run, model, engine = self._run, self.model, self.engine
        device = run.prompt.device
        scratch = self.budget - 1  # see the module docstring
        appends = []
        for i, resp in zip(rows, responses):
            if not resp:
                raise ValueError(f"row {i}: an empty response cannot be continued (the first turn samples it)")
            if len(resp) >= self.budget:
                raise ValueError(f"row {i}: {len(resp)} tokens leave no room in the session's budget of {self.budget}")
            known, reuse = self.history[i], 0
            limit = min(self.cached[i], len(resp) - 1)  # at least one token is fed: its logits start the turn
            while reuse < limit and resp[reuse] == known[reuse]:
                reuse += 1
            appends.append((reuse, resp[reuse:]))
        width = max(len(new) for _, new in appends)
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        # With compact_decode the turn's batch is the continued rows alone, in the turn's order: a copy of
        # their caches unless they are every row in order; rows that stop leave it (see the module
        # docstring). Otherwise every row runs, the others fed padding and writing only to scratch.
        compact = engine.compact_decode and not run.compiled
        views = None
        if compact:
            views = RowViews(run, self._attns, idx, rows != list(range(self.n)), "row_decode_caches")
        turn = views.current if compact else run
        batch = len(rows) if compact else self.n
        slot_of = list(range(len(rows))) if compact else rows  # each continued row's row in the turn's batch
        tokens = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [n, M]
        c = torch.full((batch, width), scratch, dtype=torch.long)  # [n, M] completion indices
        for j, (reuse, new) in zip(slot_of, appends):
            tokens[j, width - len(new):] = torch.tensor(new, dtype=torch.long)
            c[j, width - len(new):] = torch.arange(reuse, reuse + len(new))
        tokens, c = tokens.to(device), c.to(device)
        with attached_caches(self._attns, turn.extend_caches(c)):
            logits = turn.extend(model, tokens, c)  # [n, V]

        lengths = [len(r) for r in responses]
        start = torch.full((batch,), scratch, dtype=torch.long)  # rows not sampled write only to scratch
        start[slot_of] = torch.tensor(lengths, dtype=torch.long)
        start = start.to(device)
        room = torch.tensor([self.budget - n for n in lengths], dtype=torch.long, device=device)
        longest = max(lengths)
        direct = can_skip_module_hooks(model)
        stop = torch.tensor(self.stop_tokens, dtype=torch.long, device=device)

        def window(t: int) -> int:
            return min(longest + t, scratch) + 1  # completion slots written so far (eager reads)

        if compact:
            views.per_row["start"] = start

            def feed(token: torch.Tensor, t: int) -> torch.Tensor:
                at = (views.per_row["start"] + t).clamp_(max=scratch)
                return views.current.decode_rows(model, token, at, window(t), direct)

            with attached_caches(self._attns, turn.row_decode_caches):
                # The same noise as the full batch's loop: one draw per sampled row, in ``rows`` order.
                out, stopped = engine.compacting_loop(
                    logits, feed, views.compact, max_new_tokens, self.pad_id, stop, temperature, generator,
                    room=room,
                )
            views.write_back()
        else:
            with attached_caches(self._attns, turn.row_decode_caches):
                out, stopped = engine.decode_loop(
                    logits, lambda token, t: turn.decode_rows(
                        model, token, (start + t).clamp_(max=scratch), window(t), direct
                    ), max_new_tokens, self.pad_id, stop, temperature, generator, rows=idx, room=room,
                )
        rollout = to_rollout([self.prompts[i] + r for i, r in zip(rows, responses)], out, stopped, stop)
        new_ids = [ids[: self.budget - n] for ids, n in zip(rollout.response_ids, lengths)]  # the budget's cut
        for i, resp, ids in zip(rows, responses, new_ids):
            self.history[i], self.cached[i] = resp + ids, len(resp) + len(ids) - 1
        return rollout._replace(response_ids=new_ids)
