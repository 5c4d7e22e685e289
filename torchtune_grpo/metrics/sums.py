"""Per-rank quantities, each declared with how ranks combine it, reduced over ranks by key.

A step's metrics start as one rank's quantities (:class:`StepSums`): sums (rewards, tokens, counts), and
maxima or minima (the longest completion). Each is stored under a tuple key (``("component", "format")``,
not a string with a prefix to parse) together with its :class:`Reduce`. :func:`reduce_over_ranks` combines
them key by key (sorted, one collective per kind of reduction) once a collective of fixed size has shown that
every rank has the same keys: reducing lists by position would silently add one rank's ``format`` to another's
``correctness``, and lists of different lengths would make a collective of mismatched sizes.

Logged metrics are then declared over the reduced quantities (:class:`Mean`, :class:`Std`, :class:`Value`),
once, in :mod:`torchtune_grpo.training.step_metrics`.
"""

import enum
import zlib
from typing import Callable, Dict, Iterator, List, NamedTuple, Tuple, Union

__all__ = ["Key", "Mean", "Reduce", "StepSums", "Std", "Value", "one_process_sum", "reduce_over_ranks"]

#: A quantity's name, e.g. ``("reward",)`` or ``("component", "format")``.
Key = Tuple[str, ...]


class Reduce(enum.Enum):
    """How ranks combine a quantity."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


class StepSums:
    """One rank's quantities of a step, each with its :class:`Reduce` (see the module docstring)."""

    def __init__(self) -> None:
        self._values: Dict[Key, float] = {}
        self._ops: Dict[Key, Reduce] = {}

    def add(self, key: Key, value: float, op: Reduce = Reduce.SUM) -> None:
        """Add ``value`` to ``key`` (or take the max/min with what is there).

        Raises:
            ValueError: when ``key`` was added before with another reduction.
        """
        value = float(value)
        if key not in self._values:
            self._values[key], self._ops[key] = value, op
            return
        if self._ops[key] is not op:
            raise ValueError(f"metric {key} is reduced by {self._ops[key].value}, not {op.value}")
        old = self._values[key]
        self._values[key] = old + value if op is Reduce.SUM else max(old, value) if op is Reduce.MAX else min(old, value)

    def merge(self, other: "StepSums") -> "StepSums":
        """Add every quantity of ``other`` (with its reduction); returns ``self``."""
        for key, value in other._values.items():
            self.add(key, value, other._ops[key])
        return self

    def __getitem__(self, key: Key) -> float:
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[Key]:
        return iter(self._values)

    def items(self) -> Iterator[Tuple[Key, float]]:
        return iter(self._values.items())

    def op(self, key: Key) -> Reduce:
        """The reduction of ``key``."""
        return self._ops[key]

    def as_dict(self) -> Dict[Key, float]:
        """The local values (a copy)."""
        return dict(self._values)


def one_process_sum(values: List[float]) -> List[float]:
    """The sum over ranks of one process: the values themselves (the default ``all_reduce`` of the stages)."""
    return values


def _fingerprint(keys: List[Tuple[Key, str]]) -> float:
    # Small enough that a float64 sum of one per rank stays exact for any realistic number of ranks.
    return float(zlib.crc32(repr(keys).encode()) % (1 << 20))


def reduce_over_ranks(
    local: StepSums, all_reduce: Callable[[List[float], Reduce], List[float]]
) -> Dict[Key, float]:
    """``local`` combined over all ranks, key by key; every rank gets the same result.

    Args:
        local (StepSums): this rank's quantities.
        all_reduce (Callable[[List[float], Reduce], List[float]]): reduces a list of floats elementwise over
            ranks with the given reduction (``Reduce.SUM`` or ``Reduce.MAX``; every rank calls it in the same
            order). On one process: ``lambda values, op: values``.

    Returns:
        Dict[Key, float]: the reduced quantities.

    Raises:
        RuntimeError: when the ranks' keys differ (naming this rank's), instead of mixing their values.
    """
    keys = sorted(local)
    # First the key set, in a collective whose size does not depend on it: its fingerprint, its size and a rank
    # count. Only then the values: ranks whose lists had different lengths would be in a collective of mismatched
    # sizes, which no backend reports as an error (gloo aborts the process, SIGABRT; others hang), so a check after
    # it would never run.
    mine = _fingerprint([(k, local.op(k).value) for k in keys])  # a key reduced otherwise is another key
    fingerprint, count, ranks = all_reduce([mine, float(len(keys)), 1.0], Reduce.SUM)
    if fingerprint != mine * ranks or count != len(keys) * ranks:
        raise RuntimeError(
            f"The ranks computed different metrics this step (this rank has {keys}): a rank whose keys differ "
            "would have its values added to another metric's."
        )
    # Every rank has these keys: the collectives below have the same sizes everywhere, and are run (or not) alike.
    sums = [k for k in keys if local.op(k) is Reduce.SUM]
    reduced: Dict[Key, float] = dict(zip(sums, all_reduce([local[k] for k in sums], Reduce.SUM))) if sums else {}
    extremes = [k for k in keys if local.op(k) is not Reduce.SUM]
    if extremes:  # min(x) = -max(-x): one MAX collective for both
        signs = [1.0 if local.op(k) is Reduce.MAX else -1.0 for k in extremes]
        maxima = all_reduce([s * local[k] for s, k in zip(signs, extremes)], Reduce.MAX)
        reduced.update({k: s * v for s, k, v in zip(signs, extremes, maxima)})
    return reduced


class Mean(NamedTuple):
    """A logged mean: the reduced ``total`` over the reduced ``count`` (0 when the count is 0)."""

    total: Key
    count: Key

    def value(self, reduced: Dict[Key, float]) -> float:
        count = reduced[self.count]
        return reduced[self.total] / count if count else 0.0


class Std(NamedTuple):
    """A logged population standard deviation from the reduced sum, sum of squares and count."""

    total: Key
    squares: Key
    count: Key

    def value(self, reduced: Dict[Key, float]) -> float:
        mean = Mean(self.total, self.count).value(reduced)
        return max(Mean(self.squares, self.count).value(reduced) - mean**2, 0.0) ** 0.5


class Value(NamedTuple):
    """A logged quantity as reduced (a global sum, a maximum, ...)."""

    key: Key

    def value(self, reduced: Dict[Key, float]) -> float:
        return reduced[self.key]


#: Any declared metric.
Metric = Union[Mean, Std, Value]
