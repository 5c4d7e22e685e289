"""A rollout's two kinds of KV cache (shared-prefix, per-row) and their decode steps, for :class:`NativeGenerator`.

*Shared prefix* (float32 caches): each prompt's keys/values once per group plus each row's completion
(:mod:`~torchtune_grpo.generation._prefix_attention`), decoded by :func:`prefix_decode_step`. *Per row*
(half precision, attention modules with their own forward, ``share_prefill: false``): one
``[prompt | completion]`` cache per row, decoded by :func:`decode_step`. Both steps have fixed shapes when
compiled (CUDA graphs) and never read a value back to the host.

A multi-turn session (:mod:`~torchtune_grpo.generation._session`) keeps a rollout's cache after its first
turn and continues rows whose histories now differ in length: ``extend`` writes each row's appended tokens
right after its own cached tokens (per-row write slots, ``c [N, s]`` completion indices) and ``decode_rows``
decodes with a per-row slot, mask and position. Completion index ``c`` holds the row's response token ``c``
in both kinds, so a row's tokens stay contiguous whatever the other rows hold. The decode steps themselves are in
:mod:`~torchtune_grpo.generation._decode_steps`.
"""

import copy
from typing import List, Optional, Tuple

import torch
from torch import nn

from torchtune_grpo.generation._cache import CacheState, SlotKVCache
from torchtune_grpo.generation._decode_steps import additive_mask, decode_step, prefix_decode_step, RolloutResources
from torchtune_grpo.generation._prefix_attention import lean_decode_eligible, PrefixDecodeMask, SharedPrefixKVCache

__all__ = ["PerRowRollout", "RolloutResources", "SharedPrefixRollout"]


class SharedPrefixRollout:
    """One rollout in the shared-prefix layout (:mod:`~torchtune_grpo.generation._prefix_attention`).

    The prefill runs the ``B`` prompts once, writing the prompt part of the cache; the decode steps write
    and read each row's completion part and read the prompt part once per group. Eagerly the completion
    window is exactly the slots written so far (no mask); a compiled step has fixed windows (rounded up
    to ``cache_len_multiple``) and masks the rest.

    Args:
        resources (RolloutResources): the engine's cache pool, write slot, compiled steps and settings.
        layout (List[Tuple[int, int]]): ``(h_kv, head_dim)`` of each attention layer.
        prompt (torch.Tensor): ``[B, P]`` left-padded prompts.
        pad_b (torch.Tensor): ``[B]`` left padding of each prompt.
        group_size (int): rows per prompt, G.
        max_new_tokens (int): the completion budget, T.
        dtype (torch.dtype): the cache's dtype (the model's).
        device (torch.device): the model's device.
        all_cached (bool): every attention module runs the engine's cached forward.
    """

    def __init__(
        self,
        resources: RolloutResources,
        layout: List[Tuple[int, int]],
        prompt: torch.Tensor,
        pad_b: torch.Tensor,
        group_size: int,
        max_new_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        all_cached: bool,
    ) -> None:
        b, prompt_len = prompt.shape
        self.group_size = group_size
        self.decode_fn = resources.compile_step(prefix_decode_step)
        self.compiled = self.decode_fn is not prefix_decode_step
        mult = resources.cache.len_multiple
        # A compiled step is specialised on its windows: round them up to bound the number of graphs.
        p_window = -(-prompt_len // mult) * mult if self.compiled else prompt_len
        c_window = -(-max_new_tokens // mult) * mult if self.compiled else max_new_tokens
        (pk, pv), (ck, cv) = resources.cache.get(
            layout, [(b, p_window), (b * group_size, c_window)], dtype, device
        )
        if self.compiled:
            # The fixed windows read slots this rollout has not written: they are masked, but zero them
            # so that a non-finite leftover of an earlier rollout cannot leak through (0 x inf = nan).
            for c in (*pk, *pv):
                c[:, :, prompt_len:p_window].zero_()
            for c in (*ck, *cv):
                c[:, :, :c_window].zero_()
        slots = torch.arange(p_window, device=device)
        real = (slots[None, :] >= pad_b[:, None]) & (slots[None, :] < prompt_len)  # [B, Pw]
        self.prefix_mask = additive_mask(real, dtype)[:, None, None, :]  # [B, 1, 1, Pw]
        # Prefill: [B, P] causal over real tokens; a padded query row sees itself (no NaN softmax).
        p_slots = slots[:prompt_len]
        causal = p_slots[:, None] >= p_slots[None, :]
        self.prefill_mask = (causal[None] & real[:, None, :prompt_len]) | torch.eye(
            prompt_len, dtype=torch.bool, device=device
        )
        self.prefill_pos = (p_slots[None, :] - pad_b[:, None]).clamp(min=0)  # [B, P]
        self.prompt = prompt
        prefill_state = CacheState(slots=p_slots, window=prompt_len)
        self.prefill_caches = [SlotKVCache(k, v, prefill_state) for k, v in zip(pk, pv)]
        self.write_slot = resources.write_slot
        self.state = CacheState(slots=self.write_slot, window=c_window)
        self.decode_caches = [
            SharedPrefixKVCache(pk_i, pv_i, ck_i, cv_i, self.state, p_window)
            for pk_i, pv_i, ck_i, cv_i in zip(pk, pv, ck, cv)
        ]
        self.lengths = (prompt_len - pad_b).repeat_interleave(group_size)  # [N] each row's prompt length
        self.completion_slots = torch.arange(c_window, device=device) if self.compiled else None
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.lean: Optional[bool] = None  # decided at the first decode step (needs `direct`)
        self.decode_group = group_size  # decode rows per prompt row of the caches (1 after a ragged compact)
        # A session's later turns: per-row write slots over the same storage.
        self.storage, self.p_window, self.c_window = (pk, pv, ck, cv), p_window, c_window
        self.all_completion_slots = torch.arange(c_window, device=device)
        self.row_write_slot = resources.row_write_slot
        self.row_state = CacheState(slots=self.row_write_slot, window=c_window)
        self.row_decode_caches = self._caches(self.row_state)
        if self.compiled:
            for t in (*pk, *pv, *ck, *cv, self.write_slot, self.row_write_slot):
                torch._dynamo.mark_static_address(t)

    def _caches(self, state: CacheState) -> List[SharedPrefixKVCache]:
        return [SharedPrefixKVCache(*parts, state, self.p_window) for parts in zip(*self.storage)]

    def prefill(self, model: nn.Module) -> torch.Tensor:
        logits = model(self.prompt, mask=self.prefill_mask, input_pos=self.prefill_pos)  # [B, V]
        return logits.repeat_interleave(self.group_size, dim=0)

    def decode(self, model: nn.Module, token: torch.Tensor, t: int, direct: bool) -> torch.Tensor:
        if self.lean is None:
            self.lean = direct and lean_decode_eligible(model.layers)
        self.step.fill_(t)
        if not self.compiled:
            self.state.window = t + 1  # exactly the completion slots written, this token's included
            return prefix_decode_step(
                model, token, self.step, self.lengths, self.prefix_mask, self.write_slot, None, direct,
                self.lean,
            )
        torch.compiler.cudagraph_mark_step_begin()
        logits = self.decode_fn(
            model, token, self.step, self.lengths, self.prefix_mask, self.write_slot,
            self.completion_slots, direct, self.lean,
        )
        return logits.clone()  # a CUDA graph's output is overwritten by the next replay

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only decode rows ``keep`` (``[n']`` long, ascending indices into the current rows) in the
        decode caches and per-row state (a one-shot rollout's compacting decode, ``_compact.py``).

        When ``keep`` is whole groups, their prompts stay shared; otherwise each kept row gets its own copy
        of its prompt's keys/values (groups of one), so the batch can shrink to exactly the live rows.
        """
        prompts, group = self._prompt_rows(keep)
        pw, cw = self.p_window, self.c_window
        for cache in self.decode_caches:
            cache.prefix_k = cache.prefix_k[:, :, :pw].index_select(0, prompts)
            cache.prefix_v = cache.prefix_v[:, :, :pw].index_select(0, prompts)
            cache.k_cache = cache.k_cache[:, :, :cw].index_select(0, keep)
            cache.v_cache = cache.v_cache[:, :, :cw].index_select(0, keep)
            cache.batch_size = keep.numel()
        self.prefix_mask = self.prefix_mask.index_select(0, prompts)
        self.lengths = self.lengths.index_select(0, keep)
        self.decode_group = group

    def _prompt_rows(self, rows: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """The prompt rows that decode rows ``rows`` (``[n]`` long) read, and the decode rows per prompt row:
        whole groups in order keep their shared prompt (``[n / G]``, ``G``); otherwise each row gets its own
        copy (``[n]``, 1)."""
        g, r = self.decode_group, rows.tolist()
        whole = len(r) % g == 0 and all(r[j] == r[j - j % g] + j % g and r[j - j % g] % g == 0 for j in range(len(r)))
        return (rows[::g] // g, g) if whole else (rows // g, 1)

    def select_rows(self, rows: torch.Tensor) -> "SharedPrefixRollout":
        """This rollout over decode rows ``rows`` only (``[n]`` long, distinct, in the turn's order): a
        multi-turn session's turn over some rows (``_session.py``), decoded with :meth:`decode` (the first
        turn) or :meth:`decode_rows`. The rows' caches are copied (whole groups keep sharing their
        prompt); :meth:`write_rows` copies the completion part back. Eager rollouts only."""
        prompts, group = self._prompt_rows(rows)
        pw, cw = self.p_window, self.c_window
        pk, pv, ck, cv = self.storage
        view = copy.copy(self)
        view.storage = (
            [t[:, :, :pw].index_select(0, prompts) for t in pk], [t[:, :, :pw].index_select(0, prompts) for t in pv],
            [t[:, :, :cw].index_select(0, rows) for t in ck], [t[:, :, :cw].index_select(0, rows) for t in cv],
        )
        view.prefix_mask = self.prefix_mask.index_select(0, prompts)
        view.lengths = self.lengths.index_select(0, rows)
        view.decode_group = group
        view.decode_caches = view._caches(self.state)  # the first turn's shared write slot and window
        view.row_write_slot = torch.zeros(rows.numel(), 1, dtype=torch.long, device=rows.device)
        view.row_state = CacheState(slots=view.row_write_slot, window=cw)
        view.row_decode_caches = view._caches(view.row_state)
        return view

    def write_rows(self, view: "SharedPrefixRollout", rows: torch.Tensor) -> None:
        """Copy the completion caches of ``view = self.select_rows(rows)`` back to rows ``rows`` (the
        prompt part is never written after the prefill)."""
        cw = self.c_window
        for dst, src in zip((*self.storage[2], *self.storage[3]), (*view.storage[2], *view.storage[3])):
            dst[:, :, :cw].index_copy_(0, rows, src)

    def extend_caches(self, c: torch.Tensor) -> List[SharedPrefixKVCache]:
        """Caches that write an :meth:`extend` forward's tokens at completion indices ``c`` (``[N, s]``)."""
        return self._caches(CacheState(slots=c, window=self.c_window))

    def extend(self, model: nn.Module, tokens: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (``[N, s]``) at completion indices ``c`` (``[N, s]``); ``[N, V]`` logits of the
        last column. Token ``j`` of row ``i`` sees the prompt and completion slots ``<= c[i, j]``."""
        seen = self.all_completion_slots <= c.unsqueeze(-1)  # [N, s, Wc]
        mask = PrefixDecodeMask(self.prefix_mask, additive_mask(seen, self.prefix_mask.dtype).unsqueeze(1))
        return model(tokens, mask=mask, input_pos=self.lengths[:, None] + c)

    def decode_rows(
        self, model: nn.Module, token: torch.Tensor, c: torch.Tensor, window: int, direct: bool
    ) -> torch.Tensor:
        """A decode step writing row ``i``'s token at completion index ``c[i]`` (``[N]``); the
        ``row_decode_caches`` must be attached. ``window``: completion slots read when eager (``> max c``)."""
        if self.lean is None:
            self.lean = direct and lean_decode_eligible(model.layers)
        if not self.compiled:
            self.row_state.window = window
            return prefix_decode_step(
                model, token, c, self.lengths, self.prefix_mask, self.row_write_slot,
                self.all_completion_slots[:window], direct, self.lean,
            )
        torch.compiler.cudagraph_mark_step_begin()
        logits = self.decode_fn(
            model, token, c, self.lengths, self.prefix_mask, self.row_write_slot, self.all_completion_slots,
            direct, self.lean,
        )
        return logits.clone()


class PerRowRollout:
    """One rollout in the per-row layout: every row's cache holds its own copy of the prompt.

    Used for half-precision caches, attention modules that keep their own forward, and
    ``share_prefill: false``. The prefill runs each prompt once and copies its cache to the group's rows
    (or, with ``share_prefill: false``, runs every row). Arguments as for :class:`SharedPrefixRollout`;
    with ``all_cached`` false the decode mask stays boolean (what torchtune's attention documents).
    """

    def __init__(
        self,
        resources: RolloutResources,
        layout: List[Tuple[int, int]],
        prompt: torch.Tensor,
        pad_b: torch.Tensor,
        group_size: int,
        max_new_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        all_cached: bool,
    ) -> None:
        b, prompt_len = prompt.shape
        g = group_size
        self.decode_fn = resources.compile_step(decode_step)
        self.compiled = self.decode_fn is not decode_step
        # The attention window: every slot this rollout writes. A compiled step is specialised on it, so
        # round it up to bound the number of distinct graphs.
        window = prompt_len + max_new_tokens
        if self.compiled:
            window = -(-window // resources.cache.len_multiple) * resources.cache.len_multiple
        slot_ids = torch.arange(window, device=device)
        valid_b = slot_ids[None, :] >= pad_b[:, None]  # [B, W]
        self.pad = pad_b.repeat_interleave(g)  # [N]
        self.valid = valid_b.repeat_interleave(g, dim=0)  # [N, W]
        self.slot_ids = slot_ids
        # Prefill rows: one per prompt (its cache is then copied to the group), or every row.
        self.share = resources.share_prefill and g > 1
        p_pad = pad_b if self.share else self.pad
        p_valid = valid_b if self.share else self.valid
        self.prompt = prompt if self.share else prompt.repeat_interleave(g, dim=0)
        p_slots = slot_ids[:prompt_len]
        self.prefill_pos = (p_slots[None, :] - p_pad[:, None]).clamp(min=0)  # [rows, P]
        causal = p_slots[:, None] >= slot_ids[None, :]  # [P, W]
        # A padded query row would attend to nothing (NaN softmax): let it see itself.
        self.prefill_mask = (causal[None] & p_valid[:, None, :]) | (p_slots[:, None] == slot_ids[None, :])
        ((ks, vs),) = resources.cache.get(layout, [(b * g, window)], dtype, device)
        self.ks, self.vs, self.num_prompts, self.group_size, self.prompt_len = ks, vs, b, g, prompt_len
        state = CacheState(slots=p_slots, window=window)
        if self.share:
            # Rows 0, G, 2G, ...: a strided view, so the prefill writes straight into the big cache.
            self.prefill_caches = [SlotKVCache(k[::g], v[::g], state) for k, v in zip(ks, vs)]
        else:
            self.prefill_caches = [SlotKVCache(k, v, state) for k, v in zip(ks, vs)]
        self.write_slot = resources.write_slot
        self.decode_state = CacheState(slots=self.write_slot, window=window)
        self.decode_caches = [SlotKVCache(k, v, self.decode_state) for k, v in zip(ks, vs)]
        for k, v in zip(ks, vs):
            # Stale slots past the prompt are masked until written; zero them anyway so a non-finite
            # leftover can never leak through a 0-weight (0 x inf = nan).
            k[:, :, prompt_len:window].zero_()
            v[:, :, prompt_len:window].zero_()
        if self.compiled:
            for t in (*ks, *vs, self.write_slot):
                torch._dynamo.mark_static_address(t)
        self.pos = torch.tensor(prompt_len, dtype=torch.long, device=device)  # slot of the next token
        # Additive float masks when every attention runs the engine's cached forward; other attention
        # modules keep the boolean mask torchtune documents.
        self.mask_dtype = dtype if all_cached else None
        # A session's later turns: completion index c is slot prompt_len + c of the row.
        self.window = window
        self.row_write_slot = resources.row_write_slot
        self.row_decode_caches = [
            SlotKVCache(k, v, CacheState(slots=self.row_write_slot, window=window)) for k, v in zip(ks, vs)
        ]
        if self.compiled:
            torch._dynamo.mark_static_address(self.row_write_slot)

    def prefill(self, model: nn.Module) -> torch.Tensor:
        logits = model(self.prompt, mask=self.prefill_mask, input_pos=self.prefill_pos)  # [rows, V]
        if self.share:
            p, g = self.prompt_len, self.group_size
            for k, v in zip(self.ks, self.vs):
                for c in (k, v):
                    grouped = c.view(self.num_prompts, g, *c.shape[1:])
                    grouped[:, 1:, :, :p].copy_(grouped[:, :1, :, :p])
            logits = logits.repeat_interleave(g, dim=0)  # [N, V]
        return logits

    def decode(self, model: nn.Module, token: torch.Tensor, t: int, direct: bool) -> torch.Tensor:
        self.pos.fill_(self.prompt_len + t)
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.decode_fn(
            model, token, self.pos, self.pad, self.valid, self.slot_ids, self.write_slot, direct, self.mask_dtype
        )
        return logits.clone() if self.compiled else logits  # a CUDA graph's output is overwritten next replay

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only decode rows ``keep`` (``[n']`` long, ascending indices into the current rows) in the
        decode caches and per-row state (a one-shot rollout's compacting decode, ``_compact.py``)."""
        for cache in self.decode_caches:
            cache.k_cache = cache.k_cache.index_select(0, keep)
            cache.v_cache = cache.v_cache.index_select(0, keep)
            cache.batch_size = keep.numel()
        self.pad = self.pad.index_select(0, keep)
        self.valid = self.valid.index_select(0, keep)

    def select_rows(self, rows: torch.Tensor) -> "PerRowRollout":
        """This rollout over decode rows ``rows`` only (``[n]`` long, distinct, in the turn's order), for a
        session's later turn (see :meth:`SharedPrefixRollout.select_rows`); eager rollouts only."""
        w = self.window
        view = copy.copy(self)
        view.ks = [k[:, :, :w].index_select(0, rows) for k in self.ks]
        view.vs = [v[:, :, :w].index_select(0, rows) for v in self.vs]
        view.pad, view.valid = self.pad.index_select(0, rows), self.valid.index_select(0, rows)
        view.decode_caches = [SlotKVCache(k, v, self.decode_state) for k, v in zip(view.ks, view.vs)]
        view.row_write_slot = torch.zeros(rows.numel(), 1, dtype=torch.long, device=rows.device)
        view.row_decode_caches = [
            SlotKVCache(k, v, CacheState(slots=view.row_write_slot, window=w)) for k, v in zip(view.ks, view.vs)
        ]
        return view

    def write_rows(self, view: "PerRowRollout", rows: torch.Tensor) -> None:
        """Copy the completion slots of ``view = self.select_rows(rows)`` back to rows ``rows``."""
        p, w = self.prompt_len, self.window
        for dst, src in zip((*self.ks, *self.vs), (*view.ks, *view.vs)):
            dst[:, :, p:w].index_copy_(0, rows, src[:, :, p:w])

    def extend_caches(self, c: torch.Tensor) -> List[SlotKVCache]:
        """Caches that write an :meth:`extend` forward's tokens at completion indices ``c`` (``[N, s]``)."""
        state = CacheState(slots=self.prompt_len + c, window=self.window)
        return [SlotKVCache(k, v, state) for k, v in zip(self.ks, self.vs)]

    def extend(self, model: nn.Module, tokens: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (``[N, s]``) at completion indices ``c`` (``[N, s]``); ``[N, V]`` logits of the
        last column. Token ``j`` of row ``i`` sees the row's real prompt slots and slots ``<= c[i, j]``."""
        slots = self.prompt_len + c  # [N, s]
        mask = self.valid[:, None, :] & (self.slot_ids <= slots.unsqueeze(-1))  # [N, s, W]
        return model(tokens, mask=mask, input_pos=slots - self.pad[:, None])

    def decode_rows(
        self, model: nn.Module, token: torch.Tensor, c: torch.Tensor, window: int, direct: bool
    ) -> torch.Tensor:
        """A decode step writing row ``i``'s token at completion index ``c[i]`` (``[N]``); the
        ``row_decode_caches`` must be attached. ``window`` is unused: this layout reads its fixed window."""
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.decode_fn(
            model, token, self.prompt_len + c, self.pad, self.valid, self.slot_ids, self.row_write_slot, direct,
            self.mask_dtype,
        )
        return logits.clone() if self.compiled else logits
