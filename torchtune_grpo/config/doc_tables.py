"""The config key tables of the docs, generated from the schema (torchtune_grpo/config/schema.py).

``python -m torchtune_grpo.config --markdown`` rewrites the text between the marker comments::

    <!-- generated: config-keys (python -m torchtune_grpo.config --markdown) -->
    ...
    <!-- end generated: config-keys -->

in docs/recipe.md ("Config keys": every key, its default, its values and what it does) and docs/configs.md
(``config-values``: the range of every numeric key and the choices of every text key). ``--check`` exits 1
when a doc differs from the schema; tests/test_config_schema.py fails then too.
"""

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

from torchtune_grpo.config.fields import COMPONENT, LIST, SECTION, Setting, settings
from torchtune_grpo.config.schema import LoRARecipeConfig

__all__ = ["DOC_TABLES", "render", "update_docs"]


def _default(s: Setting) -> str:
    if s.shown is not None:
        return s.shown
    if s.required:
        return "required"
    if s.kind == SECTION and s.section is not None:
        return "(its keys below)"
    if s.default is None:
        return "`null`"
    return f"`{s.default}`"


def _number(s: Setting) -> str:
    return ("whole number" if s.kind is int else "number") + (f" {s.op} {s.bound:g}" if s.op else "")


def _values(s: Setting) -> str:
    """What a key accepts, in a few words."""
    if s.choices is not None:
        text = ", ".join(f"`{c}`" for c in s.choices)
    elif s.kind in (COMPONENT, LIST, SECTION):
        text = {COMPONENT: "component", LIST: "list", SECTION: "section"}[s.kind]
    else:
        text = {bool: "true/false", str: "text"}.get(s.kind) or _number(s)
    return text + (" or `null`" if s.nullable and not s.required and s.kind != COMPONENT else "")


def keys_table(schema: type = LoRARecipeConfig) -> str:
    """docs/recipe.md's table: every key of ``schema`` (default: both recipes'), a section's keys after it."""
    rows = ["| key | default | values | meaning |", "|---|---|---|---|"]
    every = [s for s in settings(schema) if not s.in_component]
    for s in every:
        if "." in s.key:
            continue
        for t in [s] + [t for t in every if t.key.startswith(s.key + ".")]:
            rows.append(f"| `{t.key}` | {_default(t)} | {_values(t)} | {t.doc} |")
    return "\n".join(rows)


def values_table(schema: type = LoRARecipeConfig) -> str:
    """docs/configs.md's table: the range of every numeric key, the choices of every text key."""
    rows = ["| key | must be | null allowed |", "|---|---|---|"]
    for s in settings(schema):
        if s.op is not None:
            rows.append(f"| `{s.key}` | {_number(s)}: {s.why} | {'yes' if s.nullable else 'no'} |")
        elif s.choices is not None:
            rows.append(f"| `{s.key}` | one of {', '.join(f'`{c}`' for c in s.choices)} | no |")
    return "\n".join(rows)


#: Which table goes between which markers of which file (relative to the repository).
DOC_TABLES: Dict[str, Dict[str, Callable[[], str]]] = {
    "docs/recipe.md": {"config-keys": keys_table},
    "docs/configs.md": {"config-values": values_table},
}


def render(text: str, tables: Dict[str, Callable[[], str]], path: str = "the file") -> str:
    """``text`` with each marked table replaced by the schema's.

    Raises:
        ValueError: naming the file and the marker when a marker pair is missing.
    """
    for name, make in tables.items():
        begin = f"<!-- generated: {name} (python -m torchtune_grpo.config --markdown) -->"
        end = f"<!-- end generated: {name} -->"
        if begin not in text or end not in text:
            raise ValueError(f"{path} has no '{begin}' ... '{end}' markers for the {name} table")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


def update_docs(root: Path, write: bool) -> List[str]:
    """The docs under ``root`` whose tables differ from the schema; with ``write``, rewritten.

    Args:
        root (Path): the repository (holding ``docs/``).
        write (bool): rewrite the files that differ.
    """
    stale = []
    for rel, tables in DOC_TABLES.items():
        path = root / rel
        text = path.read_text(encoding="utf-8")
        new = render(text, tables, rel)
        if new != text:
            stale.append(rel)
            if write:
                path.write_text(new, encoding="utf-8")
    return stale


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: ``--markdown`` writes the tables, ``--check`` reports the stale ones (exit 1)."""
    parser = argparse.ArgumentParser(prog="python -m torchtune_grpo.config", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--markdown", action="store_true", help="rewrite the key tables in docs/")
    mode.add_argument("--check", action="store_true", help="exit 1 when a table differs from the schema")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the repository (default: this package's checkout)")
    args = parser.parse_args(argv)
    stale = update_docs(args.root, write=args.markdown)
    for rel in stale:
        print(f"{'rewrote' if args.markdown else 'differs from the schema'}: {rel}", file=sys.stderr)
    return 1 if stale and args.check else 0

