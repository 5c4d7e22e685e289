"""How a config key is declared: :func:`setting` and :func:`component` make a dataclass field whose
``metadata`` holds the key's doc, range, choices and whether ``null`` is allowed; :func:`settings` reads
them back as :class:`Setting` rows, from which the checks (and :class:`~torchtune_grpo.config.checks.ConfigSchema`,
the base of every config dataclass), the derived tables and the docs are made.

The keys themselves are declared in torchtune_grpo/config/schema.py.
"""

import dataclasses
import typing
from typing import Any, List, NamedTuple, Optional, Tuple

__all__ = ["COMPONENT", "LIST", "SECTION", "Setting", "component", "setting", "settings"]

# Kinds of values besides int/float/bool/str (Setting.kind).
COMPONENT, SECTION, LIST = "component", "section", "list"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    why: Optional[str] = None,
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    null: Optional[bool] = None,
    choices: Optional[Tuple[str, ...]] = None,
    shown: Optional[str] = None,
    factory: Any = None,
) -> Any:
    """A config key: a dataclass field with its doc and rules in ``metadata``.

    Args:
        default (Any): the value when the key is absent. Default is ``dataclasses.MISSING``: required.
        doc (str): one line for docs/recipe.md (Markdown).
        why (Optional[str]): what the value means, short, for the error on a bad value. Default is None
            (``doc``).
        ge (Optional[float]): the value must be ``>= ge``. Default is None.
        gt (Optional[float]): the value must be ``> gt``. Default is None.
        null (Optional[bool]): whether an explicit ``null`` is allowed. Default is None: allowed when the
            default is None.
        choices (Optional[Tuple[str, ...]]): the allowed values of a text key. Default is None (any).
        shown (Optional[str]): the default as the docs show it, where it is computed (``batch_size x
            group_size``). Default is None (the default itself).
        factory (Any): a ``default_factory`` instead of ``default`` (closed sections). Default is None.
    """
    metadata = {"doc": doc, "why": why, "ge": ge, "gt": gt, "null": null, "choices": choices, "shown": shown}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def component(
    doc: str, *, required: bool = True, checks: Optional[type] = None, kind: str = COMPONENT,
    shown: Optional[str] = None,
) -> Any:
    """A key whose value is a ``_component_`` node (or, with ``kind``, a free-form section or a list).

    Args:
        doc (str): one line for docs/recipe.md.
        required (bool): whether a run needs it. Default is True; optional ones default to None (off).
        checks (Optional[type]): a dataclass of the component's arguments that are range-checked. Default is None.
        kind (str): ``"component"``, ``"section"`` (a free-form dict) or ``"list"``. Default is ``"component"``.
        shown (Optional[str]): the default as the docs show it. Default is None.
    """
    metadata = {"doc": doc, "kind": kind, "checks": checks, "shown": shown}
    if required:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=None, metadata=metadata)


class Setting(NamedTuple):
    """One key as the checks and the docs see it (derived from a dataclass field by :func:`settings`).

    Attributes:
        key (str): dotted (``loss.epsilon``) below the top level.
        kind (Any): ``int``, ``float``, ``bool``, ``str``, or ``"component"``/``"section"``/``"list"``.
        default (Any): the value when absent (``dataclasses.MISSING``: required; None for checked
            component arguments, whose default is the component's).
        nullable (bool): whether ``null`` is allowed.
        op (Optional[str]): ``">="`` or ``">"``, or None (no range).
        bound (Optional[float]): the range's limit.
        choices (Optional[Tuple[str, ...]]): the allowed values of a text key.
        doc (str): one line for the docs.
        why (str): what the value means, in the error on a bad value.
        shown (Optional[str]): the default as the docs show it.
        section (Optional[type]): the closed section's dataclass (kind ``"section"``), else None.
        in_component (bool): an argument of a component (its default is the component's).
    """

    key: str
    kind: Any
    default: Any
    nullable: bool
    op: Optional[str]
    bound: Optional[float]
    choices: Optional[Tuple[str, ...]]
    doc: str
    why: str
    shown: Optional[str]
    section: Optional[type]
    in_component: bool

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def settings(schema: type, prefix: str = "", in_component: bool = False) -> Tuple[Setting, ...]:
    """Every key of ``schema`` in declaration order, then the keys of its sections and checked components.

    Args:
        schema (type): a config dataclass (:class:`RecipeConfig`, a section, a ``checks`` class).
        prefix (str): prepended to each key (``"loss."``). Default is "".
        in_component (bool): ``schema`` lists a component's checked arguments. Default is False.
    """
    hints = typing.get_type_hints(schema)
    own: List[Setting] = []
    nested: List[Setting] = []
    for f in dataclasses.fields(schema):
        meta = f.metadata
        default = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        section = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        kind = meta.get("kind") or (SECTION if section else _scalar_kind(hints[f.name]))
        op, bound = (">=", meta["ge"]) if meta.get("ge") is not None else (">", meta.get("gt"))
        null = meta.get("null")
        own.append(Setting(
            key=prefix + f.name, kind=kind, default=None if in_component else default,
            nullable=(default is None) if null is None else null,
            op=op if bound is not None else None, bound=bound, choices=meta.get("choices"),
            doc=meta["doc"], why=meta.get("why") or meta["doc"], shown=meta.get("shown"),
            section=section, in_component=in_component,
        ))
        if section is not None:
            nested.extend(settings(section, f"{prefix}{f.name}.", in_component))
        if meta.get("checks") is not None:
            nested.extend(settings(meta["checks"], f"{prefix}{f.name}.", in_component=True))
    return tuple(own + nested)


def _scalar_kind(annotation: Any) -> type:
    """``int`` for ``int`` and ``Optional[int]``; likewise float, bool, str."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) is typing.Union and len(args) == 1 else annotation
