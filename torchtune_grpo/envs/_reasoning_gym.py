"""reasoning-gym tasks as a prompt dataset and a reward scored by reasoning-gym's own scorers (docs/environments.md).

reasoning-gym (``pip install "torchtune-grpo[reasoning-gym]"``) generates problems procedurally from a task name,
a seed and the task's settings, and each task scores an answer itself (``dataset.score_answer(answer, entry)``,
partial credit included for some tasks). Nothing is downloaded.

- :func:`reasoning_gym_dataset` draws ``num_samples`` problems from one task or a weighted mix of tasks (the same
  task may appear several times with different difficulty settings), formats them with the project's prompt
  styles and keeps everything the scorer needs in the row (``rg_entry``, ``rg_source``, ``rg_config``).
- :class:`ReasoningGymReward` extracts the answer (``<answer>...</answer>`` by default, reasoning-gym's own
  extraction; or the last number, for models that answer in prose) and calls the task's ``score_answer`` on it:
  no re-implementation of any scorer.

Splits: ``"validation"`` draws from a seed stream of its own, and ``"train"`` drops every problem whose question
is one of the validation split's (same ``seed`` and ``validation_size``), so held-out accuracy is measured on
questions training never saw. Every row carries ``metric_group`` (the task's label) and ``metric_groups`` (all
labels), from which the step metrics log the reward per task (``reward_by_group/<label>/mean``).
"""

import copy
import hashlib
import json
import logging
import random
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from torchtune_grpo.rewards.answers import EXTRACT_MODES, extract_answer
from torchtune_grpo.data import PromptDataset
from torchtune_grpo.envs._extras import require
from torchtune_grpo.rewards import Reward, RewardSample
from torchtune_grpo.rewards import to_plain

__all__ = ["ReasoningGymReward", "TaskSpec", "parse_tasks", "reasoning_gym_dataset", "reasoning_gym_rows"]

log = logging.getLogger(__name__)

_SPLITS = ("train", "validation")


class TaskSpec(NamedTuple):
    """One entry of a task mix.

    Attributes:
        name (str): the reasoning-gym task (``"chain_sum"``).
        weight (float): relative share of the rows drawn from this entry.
        config (Dict[str, Any]): the task's settings (its config dataclass's fields: difficulty...).
        label (str): the entry's name in rows and metrics; unique within the mix.
    """

    name: str
    weight: float
    config: Dict[str, Any]
    label: str


def parse_tasks(tasks: Union[str, Sequence[Union[str, Mapping[str, Any]]]]) -> List[TaskSpec]:
    """The task mix from its YAML forms: a name, a list of names, or a list of ``{name, weight, config, label}``.

    Args:
        tasks (Union[str, Sequence[Union[str, Mapping[str, Any]]]]): ``"chain_sum"``, ``[chain_sum, products]``
            or ``[{name: chain_sum, weight: 2, config: {max_terms: 3}, label: chain_sum_easy}, ...]``.
            ``weight`` defaults to 1, ``config`` to ``{}``, ``label`` to ``name``.

    Returns:
        List[TaskSpec]: one spec per entry, in order.

    Raises:
        ValueError: for an empty mix, an entry without ``name``, an unknown key, a negative or all-zero weight,
            or two entries with the same label (the message names the entry).
    """
    tasks = to_plain(tasks)
    entries = [tasks] if isinstance(tasks, (str, Mapping)) else list(tasks or [])
    if not entries:
        raise ValueError("dataset.tasks is empty: name a reasoning-gym task (e.g. chain_sum) or a list of them")
    specs: List[TaskSpec] = []
    for i, entry in enumerate(entries):
        entry = {"name": entry} if isinstance(entry, str) else dict(entry)
        unknown = set(entry) - {"name", "weight", "config", "label"}
        if "name" not in entry or unknown:
            raise ValueError(
                f"dataset.tasks[{i}] = {entry!r}: each task is a name or a mapping with `name` and optionally "
                f"`weight`, `config`, `label`" + (f" (unknown keys: {sorted(unknown)})" if unknown else "")
            )
        weight = float(entry.get("weight", 1.0))
        if weight < 0:
            raise ValueError(f"dataset.tasks[{i}] ({entry['name']}): weight must be >= 0, got {weight}")
        spec = TaskSpec(str(entry["name"]), weight, dict(entry.get("config") or {}), str(entry.get("label") or entry["name"]))
        if any(s.label == spec.label for s in specs):
            raise ValueError(
                f"dataset.tasks[{i}]: the label {spec.label!r} is used twice; give entries of the same task "
                "different `label`s (they name the per-task metrics)"
            )
        specs.append(spec)
    if not sum(s.weight for s in specs) > 0:
        raise ValueError("dataset.tasks: every weight is 0; at least one task needs a positive weight")
    return specs


def _stream_seed(seed: int, split: str, label: str) -> int:
    # A stable hash (Python's hash() of a str changes between processes): every rank and every resume draws
    # the same problems, and each (split, task) has a stream of its own, so adding a task changes no other's.
    return int(hashlib.sha256(f"{seed}/{split}/{label}".encode()).hexdigest()[:12], 16)


def _make_task(rg, spec: TaskSpec, seed: int, size: int):
    try:
        return rg.create_dataset(spec.name, **{**spec.config, "seed": seed, "size": size})
    except (ValueError, TypeError, AssertionError) as e:
        raise ValueError(
            f"reasoning-gym task {spec.name!r} (label {spec.label!r}) with config {spec.config}: {e}"
        ) from e


def _draw(rg, specs: List[TaskSpec], seed: int, split: str, n: int) -> List[Dict[str, Any]]:
    """``n`` rows: the entry of each row drawn by weight (seeded), then that entry's next problem."""
    picker = random.Random(_stream_seed(seed, split, "<mix>"))
    picks = picker.choices(range(len(specs)), weights=[s.weight for s in specs], k=n)
    counts = [picks.count(k) for k in range(len(specs))]
    made = {k: _make_task(rg, specs[k], _stream_seed(seed, split, specs[k].label), counts[k])
            for k in range(len(specs)) if counts[k]}
    taken = [0] * len(specs)
    labels = [s.label for s in specs]
    rows = []
    for k in picks:
        entry = made[k][taken[k]]
        taken[k] += 1
        answer = entry.get("answer")
        rows.append({
            "question": entry["question"],
            # Some tasks have no single oracle answer (the scorer checks validity): "" is then only a display value.
            "answer": "" if answer is None else str(answer),
            "rg_source": specs[k].name,
            "rg_config": specs[k].config,
            "rg_entry": _plain_entry(entry),
            "metric_group": specs[k].label,
            "metric_groups": labels,
        })
    return rows


def _plain_entry(entry: Mapping[str, Any]) -> Dict[str, Any]:
    # A deep copy, not a JSON round trip: the scorer must read the entry exactly as its task made it (some
    # metadata holds tuples), and a consumer editing its row must not change the dataset's.
    return copy.deepcopy(dict(entry))


def reasoning_gym_rows(
    tasks: Union[str, Sequence[Union[str, Mapping[str, Any]]]],
    num_samples: int = 1000,
    seed: int = 0,
    split: str = "train",
    validation_size: int = 200,
) -> Tuple[List[Dict[str, Any]], int]:
    """The rows of :func:`reasoning_gym_dataset` before formatting (see the module docstring for the splits).

    Args:
        tasks: the task mix (:func:`parse_tasks`).
        num_samples (int): problems drawn for ``"train"`` (before dropping held-out questions). Default is 1000.
        seed (int): the seed of every draw. Default is 0.
        split (str): ``"train"`` or ``"validation"``. Default is ``"train"``.
        validation_size (int): problems of the validation split; with ``split="validation"`` it is the number
            of rows. Default is 200.

    Returns:
        Tuple[List[Dict[str, Any]], int]: the rows, and how many train problems were dropped as held-out.

    Raises:
        ValueError: for a bad split, size or task mix, or a task reasoning-gym does not know.
        MissingExtraError: when reasoning-gym is not installed.
    """
    if split not in _SPLITS:
        raise ValueError(f"dataset.split must be one of {_SPLITS}, got {split!r}")
    if int(num_samples) < 1 or int(validation_size) < 0:
        raise ValueError(f"num_samples must be >= 1 and validation_size >= 0, got {num_samples}, {validation_size}")
    rg = require("reasoning-gym", "torchtune_grpo.envs.reasoning_gym_dataset")
    specs = parse_tasks(tasks)
    known = rg.factory.DATASETS
    for spec in specs:
        if spec.name not in known:
            raise ValueError(
                f"reasoning-gym has no task {spec.name!r} (dataset.tasks, label {spec.label!r}); "
                f"some it has: {sorted(known)[:12]}... ({len(known)} in all)"
            )
    held_out = _draw(rg, specs, seed, "validation", int(validation_size)) if validation_size else []
    if split == "validation":
        if not held_out:
            raise ValueError("split 'validation' needs validation_size >= 1")
        return held_out, 0
    seen = {r["question"] for r in held_out}
    rows = _draw(rg, specs, seed, "train", int(num_samples))
    kept = [r for r in rows if r["question"] not in seen]
    return kept, len(rows) - len(kept)


def reasoning_gym_dataset(
    tokenizer,
    tasks: Union[str, Sequence[Union[str, Mapping[str, Any]]]],
    num_samples: int = 1000,
    seed: int = 0,
    split: str = "train",
    validation_size: int = 200,
    max_prompt_length: Optional[int] = 256,
    prompt_style: str = "r1",
    system_prompt: Optional[str] = None,
) -> PromptDataset:
    """Prompts from reasoning-gym's procedural tasks, with everything their scorers need in each row.

    Example YAML::

        dataset:
          _component_: torchtune_grpo.envs.reasoning_gym_dataset
          tasks:
            - {name: chain_sum, weight: 2, config: {min_terms: 2, max_terms: 2, max_digits: 1}, label: sum2}
            - {name: chain_sum, weight: 1, config: {min_terms: 3, max_terms: 4, max_digits: 2}, label: sum4}
          num_samples: 2000
          seed: 0
        validation:
          _component_: torchtune_grpo.envs.reasoning_gym_dataset
          tasks: ${dataset.tasks}
          seed: ${dataset.seed}
          split: validation
          validation_size: 200

    Args:
        tokenizer: a torchtune model tokenizer (or :func:`torchtune_grpo.models.hf_tokenizer`).
        tasks: one task name, a list of names, or a list of ``{name, weight, config, label}`` (a weighted mix,
            e.g. one task at several difficulty settings).
        num_samples (int): train problems drawn. Default is 1000.
        seed (int): the seed of the draw; the validation split of the same seed is disjoint from the train split.
            Default is 0.
        split (str): ``"train"`` or ``"validation"``. Default is ``"train"``.
        validation_size (int): problems in the validation split (held out of train). Default is 200.
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 256.
        prompt_style (str): ``"r1"`` (``<think>``/``<answer>`` instruction, what the reward extracts) or ``"chat"``.
            Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text. Default is None (the style's own).

    Returns:
        PromptDataset: rows ``{tokens, prompt, answer, question, rg_source, rg_config, rg_entry, metric_group,
        metric_groups}``.

    Raises:
        ValueError: for a bad task mix (naming the entry), an unknown task, a bad split or size.
        MissingExtraError: when reasoning-gym is not installed (the message names the extra).
    """
    rows, dropped = reasoning_gym_rows(tasks, num_samples, seed, split, validation_size)
    if dropped:
        log.info(f"reasoning_gym_dataset: dropped {dropped} train problems that are held-out questions")
    return PromptDataset(
        rows, tokenizer, formatter=prompt_style, max_prompt_length=max_prompt_length,
        system_prompt=system_prompt, source_name=f"reasoning-gym split '{split}'", required_columns=("question",),
    )


class ReasoningGymReward(Reward):
    """Scores each completion with its task's own ``score_answer`` (reasoning-gym's scorer, partial credit kept).

    Reads the row's ``rg_source``, ``rg_config`` and ``rg_entry`` (written by :func:`reasoning_gym_dataset`), so it
    works for any mix of tasks and for multi-turn episodes (it scores the final answer).

    Args:
        extract (Optional[str]): what the scorer sees: ``"answer_tag"``, the text of the last
            ``<answer_tag>...</answer_tag>`` block (reasoning-gym's own ``extract_answer``; no block is no answer);
            ``"last_number"`` or ``"boxed"`` (:func:`torchtune_grpo.rewards.answers.extract_answer`, for models that answer
            in prose); None, the whole completion, stripped. Default is ``"answer_tag"``.
        answer_tag (str): the tag of ``extract="answer_tag"``. Default is ``"answer"``.
        name (str): the component's name (metrics ``reward/<name>/mean``; the ``eval_reward`` of held-out
            accuracy). Default is ``"reasoning_gym"``.

    Raises:
        ValueError: for an unknown ``extract``; (per sample, so that sample gets the fallback) when a row lacks
            the ``rg_*`` columns.
    """

    name = "reasoning_gym"

    def __init__(self, extract: Optional[str] = "answer_tag", answer_tag: str = "answer", name: str = "reasoning_gym") -> None:
        if extract not in (None, *EXTRACT_MODES):
            raise ValueError(f"ReasoningGymReward extract must be one of {EXTRACT_MODES} or null, got {extract!r}")
        self._rg = require("reasoning-gym", "torchtune_grpo.envs.ReasoningGymReward")
        from reasoning_gym.utils import extract_answer  # public module of the installed package

        self._extract_tag = extract_answer
        self.extract, self.answer_tag = extract, answer_tag
        self.name = name
        self._scorers: Dict[str, Any] = {}

    def _scorer(self, source: str, config: Mapping[str, Any]):
        # score_answer may read the task's settings, so score with a dataset built from the row's own config
        # (cached: building one is the cost of a few problems).
        key = json.dumps([source, to_plain(config)], sort_keys=True, default=str)
        if key not in self._scorers:
            self._scorers[key] = self._rg.create_dataset(source, **{**to_plain(config), "size": 1, "seed": 0})
        return self._scorers[key]

    def answer(self, completion: str) -> Optional[str]:
        """The answer the scorer sees (see ``extract``); None when there is none."""
        if self.extract is None:
            return completion.strip()
        if self.extract == "answer_tag":
            return self._extract_tag(completion, tag_name=self.answer_tag)
        return extract_answer(completion, self.extract)

    def score_one(self, sample: RewardSample) -> float:
        missing = [k for k in ("rg_source", "rg_entry") if k not in sample.fields]
        if missing:
            raise ValueError(
                f"ReasoningGymReward needs the row columns {missing}, which torchtune_grpo.envs.reasoning_gym_dataset "
                f"writes; this row has {sorted(sample.fields)}"
            )
        scorer = self._scorer(sample.fields["rg_source"], sample.fields.get("rg_config") or {})
        return float(scorer.score_answer(self.answer(sample.completion), sample.fields["rg_entry"]))
