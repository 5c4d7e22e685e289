"""The code-execution reward: the fraction of a sample's test cases that the completion's code passes."""

import os
from typing import Any, Iterator, Optional, Tuple

from torchtune_grpo.rewards._base import Reward, RewardSample
from torchtune_grpo.rewards._math import extract_answer
from torchtune_grpo.rewards._sandbox import (
    NETWORK_MODES,
    SandboxResult,
    network_namespace_available,
    normalize_tests,
    run_python_tests,
)

__all__ = ["CODE_EXTRACT_MODES", "CodeExecutionReward", "extract_code"]

#: Valid ``extract`` modes of :func:`extract_code`.
CODE_EXTRACT_MODES = ("fenced", "answer_tag", "raw")

_PYTHON_LANGS = ("python", "py", "python3", "py3")


def extract_code(text: str, mode: str = "fenced") -> Optional[str]:
    """Extracts the program from a completion.

    Args:
        text (str): the completion.
        mode (str): one of :data:`CODE_EXTRACT_MODES`. Default is ``"fenced"``.

            - ``"fenced"``: the last complete fenced block labelled python (``py``, ``python3``), else the
              last complete unlabelled block.
            - ``"answer_tag"``: the last ``<answer>...</answer>`` block, with a fenced block inside taken
              as above when there is one.
            - ``"raw"``: the whole completion.

    Returns:
        Optional[str]: the code, or None when there is none (or it is blank).

    Raises:
        ValueError: if ``mode`` is unknown.
    """
    if mode not in CODE_EXTRACT_MODES:
        raise ValueError(f"unknown code extract mode {mode!r}; valid modes are {list(CODE_EXTRACT_MODES)}")
    text = text or ""
    if mode == "raw":
        code: Optional[str] = text
    elif mode == "answer_tag":
        inner = extract_answer(text, "answer_tag")
        code = None if inner is None else (_last_fence(inner) if "```" in inner else inner)
    else:
        code = _last_fence(text)
    if code is None or not code.strip():
        return None
    return code


def _fenced_blocks(text: str) -> Iterator[Tuple[str, str]]:
    """Yields ``(language, body)`` of each complete fenced block: an opening ``` with an optional language
    tag up to the end of its line, the body, and the next ```. Linear in ``len(text)``: every search starts
    after the previous one (a regex with a lazy body is quadratic on text like ``"```" * 20000``)."""
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return
        newline = text.find("\n", start + 3)
        if newline < 0:
            return
        inner = text.rfind("```", start + 3, newline)
        if inner >= 0:  # several fences on one line: the last one opens the block
            start = inner
        header = text[start + 3 : newline].strip()
        end = text.find("```", newline + 1)
        if end < 0:
            return
        yield (header.split()[0].lower() if header else ""), text[newline + 1 : end]
        pos = end + 3


def _last_fence(text: str) -> Optional[str]:
    python, plain = None, None
    for lang, body in _fenced_blocks(text):
        if lang in _PYTHON_LANGS:
            python = body
        elif not lang:
            plain = body
    return python if python is not None else plain


class CodeExecutionReward(Reward):
    """Fraction of the sample's test cases passed by the completion's Python code, run in a sandbox.

    The code is extracted with :func:`extract_code` (no code scores 0.0) and run once, in a fresh
    interpreter in a throwaway directory with a wall-clock limit, CPU and memory limits and no network
    (see :mod:`torchtune_grpo.rewards._sandbox` for exactly what is guaranteed). Test cases come from the
    dataset column ``tests_key`` in any shape :func:`~torchtune_grpo.rewards.normalize_tests` accepts
    (assert statements, or stdin/stdout pairs). A test the code never reached (it was killed) fails.

    A sample without test cases raises (a dataset bug: the sample gets the fallback and counts as an
    error). Samples run in parallel, ``concurrency`` processes at a time.

    Example YAML::

        - _component_: torchtune_grpo.rewards.CodeExecutionReward
          tests_key: tests
          time_limit: 10
          memory_limit_mb: 1024
          weight: 1.0

    Args:
        tests_key (str): dataset field holding the test cases. Default is ``"tests"``.
        extract (str): one of :data:`CODE_EXTRACT_MODES`. Default is ``"fenced"``.
        time_limit (float): hard wall-clock seconds per sample (all its tests). Default is 10.0.
        test_time_limit (Optional[float]): soft seconds per test. Default is None.
        memory_limit_mb (Optional[int]): address-space limit, MiB. Default is 1024.
        network (str): ``"auto"`` (namespace where possible, else audit hook only), ``"namespace"``
            (required; error if unavailable) or ``"audit"``. Default is ``"auto"``.
        block_sockets (bool): audit hook against sockets. Default is True.
        restrict_writes (bool): audit hook against writes outside the throwaway directory. Default is True.
        site_packages (bool): let the code import installed packages. Default is False.
        concurrency (Optional[int]): sandboxes at once. Default is None (``os.cpu_count()``).

    Raises:
        ValueError: on an unknown ``extract`` or ``network`` mode.
        RuntimeError: if ``network="namespace"`` and namespaces are unavailable.
    """

    per_sample = True

    def __init__(
        self,
        tests_key: str = "tests",
        extract: str = "fenced",
        time_limit: float = 10.0,
        test_time_limit: Optional[float] = None,
        memory_limit_mb: Optional[int] = 1024,
        network: str = "auto",
        block_sockets: bool = True,
        restrict_writes: bool = True,
        site_packages: bool = False,
        concurrency: Optional[int] = None,
    ) -> None:
        if extract not in CODE_EXTRACT_MODES:
            raise ValueError(f"unknown code extract mode {extract!r}; valid modes are {list(CODE_EXTRACT_MODES)}")
        if network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {list(NETWORK_MODES)}, got {network!r}")
        if network == "namespace" and not network_namespace_available():
            raise RuntimeError(
                "network='namespace' needs `unshare` with unprivileged user namespaces, which this host does "
                "not allow; use network='auto' or 'audit'"
            )
        self.tests_key = tests_key
        self.extract = extract
        self.time_limit = float(time_limit)
        self.test_time_limit = test_time_limit
        self.memory_limit_mb = memory_limit_mb
        self.network = network
        self.block_sockets = block_sockets
        self.restrict_writes = restrict_writes
        self.site_packages = site_packages
        self.concurrency = int(concurrency or os.cpu_count() or 1)

    def run(self, code: str, tests: Any) -> SandboxResult:
        """Runs ``code`` against ``tests`` in the sandbox with this reward's limits.

        Args:
            code (str): the program.
            tests (Any): test cases (see :func:`~torchtune_grpo.rewards.normalize_tests`).

        Returns:
            SandboxResult: per-test results and how the run ended.
        """
        return run_python_tests(
            code,
            tests,
            time_limit=self.time_limit,
            test_time_limit=self.test_time_limit,
            memory_limit_mb=self.memory_limit_mb,
            network=self.network,
            block_sockets=self.block_sockets,
            restrict_writes=self.restrict_writes,
            site_packages=self.site_packages,
        )

    def score_one(self, sample: RewardSample) -> float:
        if self.tests_key not in sample.fields:
            raise KeyError(f"dataset fields have no test cases {self.tests_key!r}: {sorted(sample.fields)}")
        tests = normalize_tests(sample.fields[self.tests_key])  # a dataset without usable tests raises
        code = extract_code(sample.completion, self.extract)
        if code is None:
            return 0.0
        return self.run(code, tests).fraction
