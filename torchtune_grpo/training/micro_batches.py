"""Token-budget micro-batches: a step's sequences split by length, not by a fixed number of rows.

With a fixed number of rows per micro-batch, every forward pads its rows to the longest sequence in it: with
long-tailed completion lengths (a 40-token answer next to a 4,000-token one) most of the compute goes to
padding. :func:`plan_micro_batches` sorts the sequences by length (longest first) and fills each
micro-batch while the tokens its forward holds, padding included, stay within ``max_tokens`` (and a
sequence adds at most twice its own tokens): short sequences travel together, long ones alone. In the
shared-prompt layout the unit is a group (the consecutive sequences of one prompt, whose prompt is computed
once), cut into parts of similar lengths where that costs fewer tokens than padding every completion to
the group's longest. Packed rows (:mod:`~torchtune_grpo.training.packed_rows`) are planned as the rows they will be:
every sequence of the step packed first-fit (longest first) into rows as wide as its longest sequence, so
short ones fill the room long ones leave, and micro-batches made of whole rows (:func:`_packed_bins`).

The split changes nothing but floating-point summation order: every loss term is a sum over tokens divided
by the mini-batch's global counts (:mod:`torchtune_grpo.training.update`), so any assignment of rows to micro-batches
gives the same gradient. What must agree across processes is the *number* of micro-batches (every FSDP2
forward all-gathers parameters, so every rank runs the same number): :func:`agreed_counts` takes the
largest over ranks through the sum all-reduce the stages already have, and :func:`plan_micro_batches` with
``num_micro_batches`` splits the largest micro-batches until it has that many.
"""

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from torchtune_grpo.training.packed_rows import first_fit_decreasing

__all__ = ["MicroBatchPlan", "agreed_counts", "agreed_plan", "count_histogram", "plan_micro_batches"]


class MicroBatchPlan(NamedTuple):
    """Which rows go into which micro-batch.

    Attributes:
        order (List[int]): a permutation of the rows; micro-batch ``i`` is ``order[sum(sizes[:i]) :
            sum(sizes[: i + 1])]``.
        sizes (List[int]): rows per micro-batch (each at least 1).
        row_width (Optional[int]): packed rows only: the slots of every row (the step's longest sequence);
            the layout packs each micro-batch's sequences in ``order`` into rows of this width. Default is
            None (not packed).
    """

    order: List[int]
    sizes: List[int]
    row_width: Optional[int] = None

    def slices(self) -> List[slice]:
        """The micro-batches as slices of the rows taken in ``order``."""
        out, at = [], 0
        for size in self.sizes:
            out.append(slice(at, at + size))
            at += size
        return out

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """Rows of ``values`` (``[N, ...]``, in ``order``) put back in the original order."""
        out = torch.empty_like(values)
        out[torch.tensor(self.order, dtype=torch.long, device=values.device)] = values
        return out


class _Unit(NamedTuple):
    """Rows that stay in one micro-batch: one sequence, or (shared prompts) a group or part of one."""

    rows: List[int]
    prompt: int  # the prompt's length
    completion: int  # the longest response's length
    key: int = 0  # equal for units with equal prompts (the shared layout puts them in one row)


def _cost(units: Sequence[_Unit], shared: bool, packed: bool = False) -> int:
    """Tokens a forward over ``units`` holds, padding included (the layouts of training/batch.py).

    One row per sequence: ``rows x max(prompt + response)``. Shared prompts: one row per unit of ``P +
    M x C`` slots (``P`` the longest prompt, ``M`` the most sequences of a unit, ``C`` the longest response
    minus one). Packed rows (:mod:`~torchtune_grpo.training.packed_rows`): the sequences' own tokens (packing leaves
    little padding, and what it leaves depends on the packing).
    """
    if packed:
        return sum(u.prompt + u.completion for u in units)
    if not shared:
        return sum(len(u.rows) for u in units) * max(u.prompt + u.completion for u in units)
    # Units with equal prompts end up side by side (the order plan_micro_batches returns): one run of them.
    runs = {}
    for u in units:
        runs[u.key] = runs.get(u.key, 0) + len(u.rows)
    slots = max(u.prompt for u in units) + max(runs.values()) * max(max(1, u.completion - 1) for u in units)
    return len(runs) * slots


def _units(prompt_lens: List[int], response_lens: List[int], prompt_ids: Optional[List[List[int]]]) -> List[_Unit]:
    if prompt_ids is None:  # one row per sequence
        return [_Unit([i], p, r) for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]
    units: List[_Unit] = []
    keys: Dict[Tuple[int, ...], int] = {}
    for i, p in enumerate(prompt_ids):  # runs of equal consecutive prompts, as the shared layout groups them
        if units and prompt_ids[units[-1].rows[0]] == p:
            u = units[-1]
            units[-1] = u._replace(rows=u.rows + [i], completion=max(u.completion, response_lens[i]))
        else:
            units.append(_Unit([i], len(p), response_lens[i], keys.setdefault(tuple(p), len(keys))))
    return units


def _parts(unit: _Unit, response_lens: List[int], max_tokens: int, max_rows: int) -> List[_Unit]:
    """A group split into parts of similar lengths, each with its prompt once (shared-prompt layout).

    A shared row pads every completion to the group's longest: with long-tailed lengths one long completion
    makes the whole group pay for it. The group's sequences, longest first, are cut into consecutive parts
    minimising the total cost ``sum(P + M_part x C_part)`` (dynamic programming over the cut points), each
    part within ``max_tokens`` unless it is one sequence, and within ``max_rows``. Where lengths are alike
    the optimum is the whole group (the prompt computed once).
    """
    rows = sorted(unit.rows, key=lambda i: (-response_lens[i], i))
    n = len(rows)
    part = lambda a, b: _Unit(rows[a:b], unit.prompt, response_lens[rows[a]], unit.key)  # noqa: E731
    best: List[float] = [0.0] + [float("inf")] * n  # best[b]: cheapest cover of rows[:b]
    cut = [0] * (n + 1)
    for b in range(1, n + 1):
        for a in range(max(0, b - max_rows), b):
            cost = _cost([part(a, b)], True)
            if cost > max_tokens and b - a > 1:
                continue
            if best[a] + cost < best[b]:
                best[b], cut[b] = best[a] + cost, a
    parts, b = [], n
    while b > 0:
        parts.append(part(cut[b], b))
        b = cut[b]
    return parts[::-1]


def _packed_length(u: _Unit) -> int:
    # The slots a sequence takes in a packed row: prompt + response[:-1] (packed_rows.packed_layout).
    return u.prompt + max(u.completion - 1, 0)


def _packed_bins(units: List[_Unit], max_tokens: int, max_rows: int) -> "tuple[List[List[_Unit]], int]":
    """Micro-batches of packed rows: ``(bins, row_width)``; each bin within ``max_tokens`` slots (padding
    included) and ``max_rows`` sequences.

    Every row is as wide as the step's longest sequence, ``W`` slots. The sequences, longest first (ties by
    row), are packed first-fit into rows of ``W`` (a row holds at most ``max_rows`` sequences), so short ones
    fill the room long ones leave over the whole step; consecutive rows then make a micro-batch while
    ``rows x W <= max_tokens`` (at least one row) and it holds at most ``max_rows`` sequences. The plan lists
    the sequences row by row, and :func:`~torchtune_grpo.training.packed_rows.packed_layout` given ``row_width = W``
    fills rows next-fit in that order: never more rows than planned, so the budget holds for the real layout.
    """
    units = sorted(units, key=lambda u: u.rows[0])  # first-fit decreasing breaks ties by index: by row
    lengths = [_packed_length(u) for u in units]
    width = max(max(lengths), 1)
    rows = [[units[i] for i in row] for row in first_fit_decreasing(lengths, width, max_per_row=max_rows)]
    per_bin = max(1, max_tokens // width)
    bins: List[List[_Unit]] = []
    count = 0  # rows in the last bin
    for row in rows:
        if bins and count < per_bin and len(bins[-1]) + len(row) <= max_rows:
            bins[-1].extend(row)
            count += 1
        else:
            bins.append(list(row))
            count = 1
    return bins, width


def _split(bin_: List[_Unit]) -> "tuple[List[_Unit], List[_Unit]]":
    """Two halves of a micro-batch (units, or the rows of its only unit)."""
    if len(bin_) > 1:
        half = (len(bin_) + 1) // 2
        return bin_[:half], bin_[half:]
    u = bin_[0]
    half = (len(u.rows) + 1) // 2
    # The sorted order keeps the longest rows first; each half keeps the unit's prompt.
    return [u._replace(rows=u.rows[:half])], [u._replace(rows=u.rows[half:])]


def plan_micro_batches(
    prompt_lens: List[int],
    response_lens: List[int],
    *,
    max_tokens: int,
    max_rows: int,
    prompt_ids: Optional[List[List[int]]] = None,
    num_micro_batches: Optional[int] = None,
    packed: bool = False,
) -> MicroBatchPlan:
    """Assign ``N`` sequences to micro-batches of at most ``max_tokens`` tokens (padding included).

    Deterministic: units (sequences, or groups with ``prompt_ids``) sorted by padded cost, longest first
    (ties by row), each added to the current micro-batch while it stays within ``max_tokens`` and
    ``max_rows`` rows and costs at most twice its own cost (else the padding it brings outweighs
    the micro-batch saved), else opening the next one. A unit over the budget on its own gets a micro-batch to
    itself. A group is first cut into parts of similar lengths where that is cheaper than padding every
    completion to its longest (:func:`_parts`), each part with its prompt once.

    Args:
        prompt_lens (List[int]): ``N`` prompt lengths.
        response_lens (List[int]): ``N`` response lengths.
        max_tokens (int): tokens per forward, padding included (see :func:`_cost`).
        max_rows (int): sequences per micro-batch at most.
        prompt_ids (Optional[List[List[int]]]): the prompts, for the shared-prompt layout (equal
            consecutive prompts form a unit); None: one row per sequence. Default is None.
        num_micro_batches (Optional[int]): exactly this many micro-batches (at least the budget's count, at
            most ``N``; e.g. the largest count over ranks): the costliest are halved until there are as many.
            Default is None (the budget's count).
        packed (bool): the micro-batches are packed rows (one row per sequence otherwise; not with
            ``prompt_ids``), planned as their rows (:func:`_packed_bins`). Default is False.

    Returns:
        MicroBatchPlan: the row order and the micro-batch sizes.
    """
    if max_tokens < 1 or max_rows < 1:
        raise ValueError(f"max_tokens and max_rows must be >= 1, got {max_tokens}, {max_rows}")
    shared = prompt_ids is not None
    units = [
        part for u in _units(prompt_lens, response_lens, prompt_ids)
        for part in (_parts(u, response_lens, max_tokens, max_rows) if shared else [u])
    ]
    units.sort(key=lambda u: (-_cost([u], shared), u.rows[0]))  # by length, whatever the layout
    row_width = None
    if packed and not shared:
        bins, row_width = _packed_bins(units, max_tokens, max_rows)
    else:
        bins = []
        for u in units:
            if bins:
                grown = bins[-1] + [u]
                cost = _cost(grown, shared)
                marginal_ok = cost - _cost(bins[-1], shared) <= 2 * _cost([u], shared)
                if sum(len(x.rows) for x in grown) <= max_rows and cost <= max_tokens and marginal_ok:
                    bins[-1] = grown
                    continue
            bins.append([u])
    if num_micro_batches is not None:
        if not len(bins) <= num_micro_batches <= len(prompt_lens):
            raise ValueError(
                f"num_micro_batches {num_micro_batches} is not between {len(bins)} (the budget's) and "
                f"{len(prompt_lens)} (the rows)"
            )
        while len(bins) < num_micro_batches:
            splittable = [i for i, b in enumerate(bins) if sum(len(u.rows) for u in b) > 1]
            i = max(splittable, key=lambda j: (_cost(bins[j], shared, packed), -j))
            bins[i : i + 1] = list(_split(bins[i]))
    # Within a micro-batch, units with equal prompts side by side (stable), as _cost assumes; packed rows
    # keep the planned row order (their units all have key 0).
    order = [r for b in bins for u in sorted(b, key=lambda u: u.key) for r in u.rows]
    return MicroBatchPlan(order, [sum(len(u.rows) for u in b) for b in bins], row_width)


def count_histogram(count: int, max_count: int) -> List[float]:
    """``count`` as a one-hot list of ``max_count + 1`` floats: summed over ranks, a histogram of counts."""
    if not 0 <= count <= max_count:
        raise ValueError(f"count {count} is not in [0, {max_count}]")
    out = [0.0] * (max_count + 1)
    out[count] = 1.0
    return out


def agreed_counts(summed: Sequence[float], max_count: int) -> List[int]:
    """The largest count of each histogram in ``summed`` (``count_histogram`` lists concatenated, then
    summed over ranks): the number of micro-batches every rank runs.

    A maximum through a sum all-reduce, so that the stages keep their one collective per update.
    """
    width = max_count + 1
    if len(summed) % width:
        raise ValueError(f"{len(summed)} values are not histograms of width {width}")
    out = []
    for h in range(len(summed) // width):
        hist = summed[h * width : (h + 1) * width]
        out.append(max(i for i, v in enumerate(hist) if v > 0.5))
    return out


def agreed_plan(
    prompt_lens: List[int],
    response_lens: List[int],
    *,
    max_tokens: int,
    max_rows: int,
    prompt_ids: Optional[List[List[int]]] = None,
    packed: bool = False,
    all_reduce: Callable[[List[float]], List[float]],
) -> MicroBatchPlan:
    """:func:`plan_micro_batches` with the number of micro-batches agreed over ranks (one all-reduce).

    Every rank must hold the same number of rows ``N``.
    """
    kw = dict(max_tokens=max_tokens, max_rows=max_rows, prompt_ids=prompt_ids, packed=packed)
    local = plan_micro_batches(prompt_lens, response_lens, **kw)
    n = len(prompt_lens)
    (count,) = agreed_counts(all_reduce(count_histogram(len(local.sizes), n)), n)
    if count == len(local.sizes):
        return local
    return plan_micro_batches(prompt_lens, response_lens, num_micro_batches=count, **kw)
