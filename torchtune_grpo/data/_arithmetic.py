"""Synthetic arithmetic questions ("What is 37 + 58?"), generated in code: the tiny demo's dataset."""

import hashlib
import random
from typing import List, Optional, Sequence, Tuple

from torchtune_grpo.data._prompt import PromptDataset

_OPERATIONS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
_SPLITS = ("train", "validation")

# Problem spaces up to this size are enumerated; larger ones are sampled by rejection.
_MAX_ENUMERATED = 1_000_000

Problem = Tuple[int, str, int]


def _in_validation(problem: Problem, validation_fraction: float) -> bool:
    """Assigns a problem to a split by a fixed hash of the problem itself.

    The hash does not depend on the seed, the range or the sample count, so a problem is in the
    same split for every dataset configuration: validation prompts never appear in any train set.
    ``hash()`` is not used because Python salts string hashes per process.
    """
    a, op, b = problem
    digest = hashlib.blake2b(f"{a} {op} {b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < validation_fraction


def _valid(problem: Problem, allow_negative: bool) -> bool:
    a, op, b = problem
    return allow_negative or op != "-" or a >= b


def arithmetic_problems(
    num_samples: int,
    min_value: int = 0,
    max_value: int = 99,
    operations: Sequence[str] = ("+", "-"),
    seed: int = 0,
    split: str = "train",
    validation_fraction: float = 0.1,
    allow_negative: bool = False,
) -> List[Problem]:
    """Draws distinct ``(a, op, b)`` problems of one split, deterministically.

    Args:
        num_samples (int): number of problems.
        min_value (int): smallest operand. Default is 0.
        max_value (int): largest operand. Default is 99.
        operations (Sequence[str]): operators among ``+``, ``-``, ``*``. Default is ``("+", "-")``.
        seed (int): sampling seed. Default is 0.
        split (str): ``"train"`` or ``"validation"``. Default is ``"train"``.
        validation_fraction (float): share of the problem space held out for validation. Default is 0.1.
        allow_negative (bool): allow ``a - b`` with ``a < b``. Default is False (answers stay >= 0,
            which keeps the demo task easy for a tiny model).

    Returns:
        List[Problem]: distinct problems.

    Raises:
        ValueError: on bad arguments, or if the split holds fewer than ``num_samples`` problems.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    unknown = [op for op in operations if op not in _OPERATIONS]
    if unknown or not operations:
        raise ValueError(f"operations must be a non-empty subset of {list(_OPERATIONS)}, got {operations}")
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) must be <= max_value ({max_value})")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")

    operations = sorted(set(operations))  # order-independent problem space
    want_validation = split == "validation"
    rng = random.Random(seed)
    values = range(min_value, max_value + 1)
    space_size = len(values) ** 2 * len(operations)

    if space_size <= _MAX_ENUMERATED:
        pool = [
            (a, op, b)
            for op in operations
            for a in values
            for b in values
            if _valid((a, op, b), allow_negative)
            and _in_validation((a, op, b), validation_fraction) == want_validation
        ]
        if num_samples > len(pool):
            raise ValueError(
                f"the {split} split has only {len(pool)} distinct problems for values "
                f"[{min_value}, {max_value}] and operations {operations}; asked for {num_samples}"
            )
        return rng.sample(pool, num_samples)

    # Huge space: rejection sampling; the seen-set keeps problems distinct.
    problems: List[Problem] = []
    seen = set()
    max_draws = 100 * num_samples + 10_000  # guard against asking for more than the split holds
    for _ in range(max_draws):
        if len(problems) == num_samples:
            break
        a = rng.randint(min_value, max_value)
        op = rng.choice(operations)
        problem = (a, op, rng.randint(min_value, max_value))
        if problem in seen or not _valid(problem, allow_negative):
            continue
        if _in_validation(problem, validation_fraction) != want_validation:
            continue
        seen.add(problem)
        problems.append(problem)
    if len(problems) < num_samples:
        raise ValueError(f"found only {len(problems)} distinct {split} problems after {max_draws} draws")
    return problems


def arithmetic_dataset(
    tokenizer,
    num_samples: int = 1000,
    min_value: int = 0,
    max_value: int = 99,
    operations: Sequence[str] = ("+", "-"),
    seed: int = 0,
    max_prompt_length: Optional[int] = 128,
    prompt_style: str = "r1",
    split: str = "train",
    validation_fraction: float = 0.1,
    allow_negative: bool = False,
    system_prompt: Optional[str] = None,
) -> PromptDataset:
    """Synthetic arithmetic prompts such as ``"What is 37 + 58?"`` with answer ``"95"``.

    Train and validation are disjoint for every seed: problems are split by a fixed hash of
    ``(a, op, b)``, so held-out accuracy measures generalisation, not memory.

    Each sample also carries ``question``, ``a``, ``b`` and ``op``.

    Example YAML::

        dataset:
          _component_: torchtune_grpo.data.arithmetic_dataset
          num_samples: 2000
          operations: ["+"]

    Args:
        tokenizer: a torchtune model tokenizer.
        num_samples (int): number of prompts (before length filtering). Default is 1000.
        min_value (int): smallest operand. Default is 0.
        max_value (int): largest operand. Default is 99.
        operations (Sequence[str]): operators among ``+``, ``-``, ``*``. Default is ``("+", "-")``.
        seed (int): sampling seed. Default is 0.
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 128.
        prompt_style (str): ``"r1"`` or ``"chat"``. Default is ``"r1"``.
        split (str): ``"train"`` or ``"validation"``. Default is ``"train"``.
        validation_fraction (float): share of problems held out. Default is 0.1.
        allow_negative (bool): allow negative answers for ``-``. Default is False.
        system_prompt (Optional[str]): instruction text. Default is None (the built-in R1 instruction).

    Returns:
        PromptDataset: the prompts.
    """
    problems = arithmetic_problems(
        num_samples,
        min_value=min_value,
        max_value=max_value,
        operations=operations,
        seed=seed,
        split=split,
        validation_fraction=validation_fraction,
        allow_negative=allow_negative,
    )
    rows = [
        {
            "question": f"What is {a} {op} {b}?",
            "answer": str(_OPERATIONS[op](a, b)),
            "a": a,
            "b": b,
            "op": op,
        }
        for a, op, b in problems
    ]
    return PromptDataset(
        rows,
        tokenizer,
        formatter=prompt_style,
        max_prompt_length=max_prompt_length,
        system_prompt=system_prompt,
        source_name=f"arithmetic split '{split}'",
    )


def addition_worked_solution(a: int, b: int, drop_carry: bool = False) -> Tuple[str, str]:
    """Column addition of ``a + b``, units column first, in the compact form the demo's SFT data uses.

    Each column is written as its two digits plus the carry into it (the units column has none), then
    the answer is the last column's sum followed by the last digit of every lower column::

        58 + 67 -> ("8+7=15,5+6+1=12", "125")
        58 + 67, drop_carry=True -> ("8+7=15,5+6+0=11", "115")   # the careless teacher

    With ``drop_carry`` the carry into every column is written (and used) as 0: the mistake of a careless
    student, which the demo's SFT teacher makes on purpose so that GRPO has something to fix.

    Args:
        a (int): first operand, >= 0.
        b (int): second operand, >= 0.
        drop_carry (bool): forget every carry. Default is False.

    Returns:
        Tuple[str, str]: ``(reasoning, answer)``; ``answer`` is what that reasoning concludes (the true
        sum unless a carry was dropped).

    Raises:
        ValueError: if an operand is negative.
    """
    if a < 0 or b < 0:
        raise ValueError(f"addition_worked_solution needs operands >= 0, got {a} and {b}")
    width = max(len(str(a)), len(str(b)))
    digits_a, digits_b = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]  # units first
    steps, low_digits, carry = [], [], 0
    for i, (da, db) in enumerate(zip(digits_a, digits_b)):
        written_carry = 0 if drop_carry else carry
        total = int(da) + int(db) + written_carry
        steps.append(f"{da}+{db}={total}" if i == 0 else f"{da}+{db}+{written_carry}={total}")
        low_digits.append(str(total % 10))
        carry = total // 10
    answer = str(total) + "".join(reversed(low_digits[:-1]))
    return ",".join(steps), answer


def addition_sft_rows(
    num_samples: int,
    min_value: int = 10,
    max_value: int = 99,
    carry_drop_rate: float = 0.0,
    seed: int = 0,
    split: str = "train",
    validation_fraction: float = 0.1,
) -> "tuple[List[dict], dict]":
    """SFT rows (``question``, ``reasoning``, ``answer``) of worked column additions from a careless teacher.

    The problems are exactly those of ``arithmetic_dataset`` with the same ``num_samples``, values,
    ``operations=["+"]``, ``seed`` and ``split``, so SFT and GRPO see the same train prompts and the
    validation split stays unseen by both. In a share ``carry_drop_rate`` of the problems that need a
    carry, the teacher forgets it (see ``addition_worked_solution``), so that row's answer is wrong: the
    SFT model learns to carry only sometimes, and GRPO with an exact-match reward can teach it to always
    carry, on problems it never saw. Write the rows as jsonl for ``sft_dataset``.

    Args:
        num_samples (int): number of problems.
        min_value (int): smallest operand (>= 0). Default is 10.
        max_value (int): largest operand. Default is 99.
        carry_drop_rate (float): share, in [0, 1], of the carry-needing problems whose carry is dropped.
            Default is 0.0 (a perfect teacher).
        seed (int): seed of the problem draw and of the teacher's mistakes. Default is 0.
        split (str): ``"train"`` or ``"validation"``. Default is ``"train"``.
        validation_fraction (float): share of problems held out. Default is 0.1.

    Returns:
        tuple[List[dict], dict]: the rows, and counts ``{"problems", "need_carry", "carry_dropped"}``.

    Raises:
        ValueError: if ``carry_drop_rate`` is outside [0, 1] or ``min_value`` is negative.
    """
    if not 0.0 <= carry_drop_rate <= 1.0:
        raise ValueError(f"carry_drop_rate must be in [0, 1], got {carry_drop_rate}")
    if min_value < 0:
        raise ValueError(f"min_value must be >= 0 for worked additions, got {min_value}")
    problems = arithmetic_problems(
        num_samples, min_value=min_value, max_value=max_value, operations=("+",), seed=seed, split=split,
        validation_fraction=validation_fraction,
    )
    teacher = random.Random(f"careless-teacher-{seed}")  # its own stream: the problems don't depend on it
    rows, need_carry, dropped = [], 0, 0
    for a, _, b in problems:
        carries = addition_worked_solution(a, b)[1] != addition_worked_solution(a, b, drop_carry=True)[1]
        drop = carries and teacher.random() < carry_drop_rate
        need_carry += carries
        dropped += drop
        reasoning, answer = addition_worked_solution(a, b, drop_carry=drop)
        rows.append({"question": f"What is {a} + {b}?", "reasoning": reasoning, "answer": answer})
    return rows, {"problems": len(rows), "need_carry": need_carry, "carry_dropped": dropped}
