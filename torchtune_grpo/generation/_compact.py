"""A decode loop whose batch shrinks as rows stop: decode cost follows the rows still generating.

The plain loop (``NativeGenerator.decode_loop``) decodes every row until the last one stops, feeding
padding to the rows that are done: with long-tailed lengths most of a rollout's decode steps then run on
rows whose output is thrown away. Here, at each stop check (every ``stop_check_interval`` tokens, where the
plain loop already reads ``done`` back to the host), the rows that are done leave the decode batch: the
layout's :meth:`compact` keeps only the live rows of every KV cache (a copy of the live rows' caches, about
one decode step's worth of memory traffic, only when a quarter of the batch or more has stopped since the
last one).

What a row samples does not depend on which rows are still decoded: the sampling noise is drawn for the
whole batch every step (the same ``[N, V]`` draw as the plain loop, so a seeded generator also ends in the
same state) and the live rows' part taken; the loop runs exactly as many steps as the plain one. The
logits of a live row are the same function of the same cached keys and values; only the batch size of
the matrix products changes, and with it, on some BLAS kernels, the last bits of a row's result (CPU
fp32: rows of a ``[n, 576] x [576, k]`` product differ from the full batch's by ~1 ulp for some ``n``).
Tokens are therefore the same unless two candidates are that close (tested token for token on tiny models,
greedy and seeded, both kinds of rollout cache).
"""

from typing import Callable, Optional

import torch

from torchtune_grpo.generation._sampling import sample_tokens

__all__ = ["compacting_decode_loop"]


def compacting_decode_loop(
    logits: torch.Tensor,
    feed: Callable[[torch.Tensor, int], torch.Tensor],
    compact: Callable[[torch.Tensor], None],
    *,
    max_new_tokens: int,
    pad_id: int,
    stop: torch.Tensor,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    stop_check_interval: int,
    generator: Optional[torch.Generator],
    min_drop_fraction: float = 0.25,
    sample: Callable[..., torch.Tensor] = sample_tokens,
    room: Optional[torch.Tensor] = None,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Sample and feed back (``feed(token [n], t) -> logits [n, V]`` for the live rows) until all stop.

    Args:
        logits (torch.Tensor): ``[N, V]`` the first token's logits.
        feed (Callable[[torch.Tensor, int], torch.Tensor]): one decode step of the live rows.
        compact (Callable[[torch.Tensor], None]): ``compact(keep)`` keeps rows ``keep`` (``[n']`` long,
            indices into the current live rows, ascending) of the layout's caches and per-row state.
        max_new_tokens (int): tokens per row at most.
        pad_id (int): written after a row's stop token.
        stop (torch.Tensor): ``[S]`` stop token ids.
        temperature (float): sampling temperature (0: greedy).
        top_k (Optional[int]): top-k filter.
        top_p (float): nucleus mass.
        stop_check_interval (int): tokens between stop checks (and compactions).
        generator (Optional[torch.Generator]): sampling RNG.
        min_drop_fraction (float): compact when at least this fraction of the decode batch has stopped.
            Default is 0.25.
        sample (Callable[..., torch.Tensor]): :func:`~torchtune_grpo.generation.sample_tokens` or a
            function with its signature (the engine passes its own, so one patch of it covers both loops).
            Default is ``sample_tokens``.
        room (Optional[torch.Tensor]): ``[N]`` tokens each row may still take (a multi-turn session's
            budget); a row out of room is done, as if it had stopped, but not ``stopped``. None: no limit
            but ``max_new_tokens``. Default is None.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``out [N, steps]`` and ``stopped [N]``, as the plain loop.
    """
    n_all = logits.size(0)
    device = logits.device
    out = torch.full((n_all, max_new_tokens), pad_id, dtype=torch.long, device=device)
    stopped = torch.zeros(n_all, dtype=torch.bool, device=device)  # [N] a stop token came
    done = stopped.clone()  # [N] stopped or out of room: fed padding, not sampled from
    live = torch.arange(n_all, device=device)  # [n] the rows in the decode batch, ascending
    steps = 0
    for t in range(max_new_tokens):
        full = live.numel() == n_all
        token = sample(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
            noise_rows=None if full else live, noise_batch=n_all,
        )  # [n]
        done_live = done.index_select(0, live)  # [n]
        token = token.masked_fill(done_live, pad_id)
        out[live, t] = token
        stopped_live = stopped.index_select(0, live) | (torch.isin(token, stop) & ~done_live)
        stopped.index_copy_(0, live, stopped_live)
        done_now = stopped_live if room is None else stopped_live | (room.index_select(0, live) <= t + 1)
        done.index_copy_(0, live, done_now)
        steps = t + 1
        if steps == max_new_tokens:
            break
        if steps % stop_check_interval == 0:
            still = ~done.index_select(0, live)  # [n]
            alive = int(still.sum())  # the host sync the plain loop's check makes too
            if alive == 0:
                break
            if live.numel() - alive >= min_drop_fraction * live.numel():
                keep = still.nonzero().squeeze(1)  # [n'] ascending
                compact(keep)
                live, token = live.index_select(0, keep), token.index_select(0, keep)
        logits = feed(token, t)
    return out[:, :steps], stopped
