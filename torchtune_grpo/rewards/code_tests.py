"""Code test cases: the one format code datasets check and the execution reward runs."""

import json
from typing import Any, Dict, List

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["normalize_tests"]


def normalize_tests(tests: Any) -> List[Dict[str, str]]:
    """Turns a dataset's test cases into the runner's list of tests.

    Accepted shapes:

    - a list of Python statements (``["assert add(1, 2) == 3", ...]``, MBPP/HumanEval style): each runs
      after the solution, in the solution's namespace; it passes when it raises nothing;
    - a list of ``{"input": str, "output": str}`` (stdin/stdout, APPS/CodeContests style): the solution
      runs as ``__main__`` with that stdin; it passes when its stdout equals ``output`` (trailing
      whitespace of each line and surrounding blank lines ignored);
    - ``{"inputs": [...], "outputs": [...]}``: the same, column-wise;
    - a JSON string of any of the above, or any other string: one test script.

    Args:
        tests (Any): the dataset value.

    Returns:
        List[Dict[str, str]]: ``{"kind": "assert", "source": ...}`` or ``{"kind": "io", "input": ...,
        "output": ...}`` items.

    Raises:
        ValueError: on an empty or unrecognised value.
    """
    if isinstance(tests, (DictConfig, ListConfig)):  # a YAML value
        tests = OmegaConf.to_container(tests, resolve=True)
    if isinstance(tests, str):
        stripped = tests.strip()
        if stripped[:1] in ("[", "{"):
            try:
                return normalize_tests(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        if not stripped:
            raise ValueError("empty test cases")
        return [{"kind": "assert", "source": tests}]
    if isinstance(tests, dict):
        if "inputs" in tests and "outputs" in tests:
            ins, outs = list(tests["inputs"]), list(tests["outputs"])
            if len(ins) != len(outs):
                raise ValueError(f"{len(ins)} inputs but {len(outs)} outputs in test cases")
            tests = [{"input": i, "output": o} for i, o in zip(ins, outs)]
        elif "input" in tests and "output" in tests:
            tests = [tests]
        else:
            raise ValueError(f"test cases dict needs inputs/outputs, got keys {sorted(tests)}")
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"test cases must be a non-empty list, got {type(tests).__name__}: {str(tests)[:100]!r}")
    out = []
    for t in tests:
        if isinstance(t, str):
            out.append({"kind": "assert", "source": t})
        elif isinstance(t, dict) and t.get("kind") == "assert" and isinstance(t.get("source"), str):
            out.append({"kind": "assert", "source": t["source"]})  # already normalised
        elif isinstance(t, dict) and "input" in t and "output" in t:
            out.append({"kind": "io", "input": _io_text(t["input"]), "output": _io_text(t["output"])})
        else:
            raise ValueError(f"unrecognised test case {str(t)[:100]!r}: expected a statement or {{input, output}}")
    return out


def _io_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return str(value)
