"""Old module paths of torchtune_grpo, kept importable for one release after the package was folded into
folders (docs/architecture.md).

One table maps each old module name to its new home, and one import hook (installed by
``torchtune_grpo/__init__.py``) serves every old name from it: ``import torchtune_grpo.advantages``, a
YAML ``_component_: torchtune_grpo.advantages.GroupRelativeAdvantage``, a pickle that names an old class
and ``python -m torchtune_grpo.rollout_worker`` all get the new module, with a :class:`FutureWarning`
naming the new path. The old name is an alias in ``sys.modules`` of the same module object, so classes and
module state are shared, not copied. No file is left at an old path.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import CodeType, ModuleType
from typing import Dict, Optional, Sequence

__all__ = ["MOVED", "MOVED_NAMES", "install", "moved_message"]

#: Old module (under ``torchtune_grpo.``) -> the module that holds its contents now.
MOVED: Dict[str, str] = {
    "advantages": "rollouts.advantages",
    "algorithm_card": "config.algorithm_card",
    "answers": "rewards.answers",
    "attention": "models.attention",
    "chat_prompts": "models.chat_prompts",
    "checkpoint_manager": "checkpoints.manager",
    "checkpointer_facts": "checkpoints.checkpointer_facts",
    "checkpointing": "checkpoints.storage",
    "code_tests": "rewards.code_tests",
    "collectives": "runtime.collectives",
    "config_checks": "config.checks",
    "config_docs": "config.doc_tables",
    "config_fields": "config.fields",
    "config_schema": "config.schema",
    "crash_points": "runtime.crash_points",
    "diagnostics": "training.diagnostics",
    "dynamic_sampling": "rollouts.group_selection",
    "evaluation": "rollouts.evaluation",
    "experience": "training.experience",
    "logprobs": "models.logprobs",
    "lora": "models.lora",
    "lora_setup": "runtime.lora_setup",
    "loss_masks": "loss.masks",
    "metric_sums": "metrics.sums",
    "micro_batching": "training.micro_batches",
    "model_setup": "runtime.model_setup",
    "nonfinite": "runtime.nonfinite",
    "offpolicy": "loss.rollout_correction",
    "output_lock": "runtime.output_lock",
    "packed_rows": "training.packed_rows",
    "plotting": "metrics.plotting",
    "precision": "runtime.precision",
    "preemption": "runtime.preemption",
    "producer": "rollouts.producer",
    "quiet": "runtime.quiet",
    "rejection_sampling": "rollouts.rejection_sampling",
    "resume": "checkpoints.resume",
    "rollout": "rollouts.groups",
    "rollout_worker": "workers.process",
    "run_logs": "metrics.run_logs",
    "setup_checks": "runtime.model_setup",
    "sharding": "runtime.sharding",
    "step_metrics": "training.step_metrics",
    "token_selection": "loss.token_selection",
    "train_step": "training.step",
    "training_batch": "training.batch",
    "update": "training.update",
    "waits": "runtime.waits",
    "worker_channel": "workers.channel",
    "worker_rollouts": "workers.client",
}

#: Public names that left their old module for another one: old module -> {name: module that holds it now}.
#: The old module path then serves a module of its own that looks these names up where they are.
MOVED_NAMES: Dict[str, Dict[str, str]] = {
    "config_checks": {"validate_config": "config"},  # config.checks' own needs the schema passed
    "config_fields": {"ConfigSchema": "config.checks"},
    # Experience is the experience builder's output; the no-grad logprobs of a TrainingBatch are the batch's.
    "update": {"batch_logprobs": "training.batch", "batch_token_logprobs": "training.batch"},
    # The setup checks, each beside what it checks.
    "setup_checks": {
        "check_evaluation_keys": "rollouts.evaluation",
        "check_generation_workers": "workers.config_checks",
        "check_output_dir": "runtime.output_lock",
        "training_layout": "training.batch",
    },
}

_PACKAGE = "torchtune_grpo."


def moved_message(old: str, new: str) -> str:
    """The deprecation message for an old module path (both names in full)."""
    return f"{old} moved to {new}; the old path works until the next release"


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the new module: imports it, warns, and lets the import system alias it."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        warnings.warn(moved_message(self.old, self.new), FutureWarning, stacklevel=_caller_level())
        self._spec = module.__spec__
        names = MOVED_NAMES.get(self.old[len(_PACKAGE):])
        if names:
            return _names_elsewhere(self.old, module, names)
        return module  # the import system stores it as sys.modules[old]: one module under two names

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the alias's spec on the shared module; the module keeps its own (pickling,
        # reloading and multiprocessing read it).
        if module.__name__ != self.old:
            module.__spec__ = self._spec

    def get_code(self, fullname: str) -> CodeType:
        """``python -m <old name>`` (runpy asks for code to run as ``__main__``): warn, run the new one."""
        source = (
            "import runpy, warnings\n"
            f"warnings.warn({moved_message(self.old, self.new)!r}, FutureWarning)\n"
            f"runpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{self.old}>", "exec")

    def is_package(self, fullname: str) -> bool:
        return False


def _names_elsewhere(old: str, module: ModuleType, names: Dict[str, str]) -> ModuleType:
    """A module for ``old`` whose attributes are ``module``'s, and ``names`` from the modules now holding
    them (each warns once, naming where it is)."""
    proxy = ModuleType(old, module.__doc__)

    def __getattr__(name: str) -> object:
        if name in names:
            where = _PACKAGE + names[name]
            warnings.warn(moved_message(f"{old}.{name}", f"{where}.{name}"), FutureWarning, stacklevel=2)
            value = getattr(importlib.import_module(where), name)
        else:
            value = getattr(module, name)
        setattr(proxy, name, value)  # looked up once
        return value

    proxy.__getattr__ = __getattr__  # type: ignore[attr-defined]  # PEP 562: a module's __getattr__
    proxy.__all__ = sorted(set(getattr(module, "__all__", ())) | set(names))  # type: ignore[attr-defined]
    return proxy


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old module names of :data:`MOVED` (and nothing else)."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(_PACKAGE) or fullname[len(_PACKAGE):] not in MOVED:
            return None
        new = _PACKAGE + MOVED[fullname[len(_PACKAGE):]]
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(fullname, new))


def _caller_level() -> int:
    """The ``stacklevel`` that points the warning at the code that imported the old name, past the import
    system's frames."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_code.co_filename == __file__
    ):
        frame, level = frame.f_back, level + 1
    return level


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once; after the path finders, which find the new modules)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
