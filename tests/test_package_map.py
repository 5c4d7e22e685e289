"""The package as a map (docs/architecture.md): a short top level of folders that follow a GRPO step, no
import circles between its modules or its folders, every ``_component_`` path the configs and the docs show
resolving, and every module path from before the folders still importable, with a warning naming the new one.

The circles are found statically (the source's ``import`` statements, at module level and inside functions
alike), so a lazy import that closes a circle counts as one.
"""

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Set

import pytest

from torchtune_grpo._moved import MOVED, MOVED_NAMES, moved_message

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "torchtune_grpo"

#: At most this many public entries (folders and modules not starting with "_") at the top level.
MAX_TOP_LEVEL = 16

#: The full recipe's class reads top to bottom as a step happens; a stage that grows goes to its own module.
MAX_RECIPE_CLASS_LINES = 450

#: The public names (``__all__``) of every top-level module before the folders: each must still import
#: from its old path.
OLD_PUBLIC_NAMES = {
    "advantages": "AdvantageEstimator AdvantageOutput BatchStdAdvantage ComponentNormalization GroupRelativeAdvantage RLOOAdvantage RewardStats advantage_signal normalize_components zero_variance_groups",
    "algorithm_card": "AlgorithmSpec algorithm_card config_values write_algorithm_card",
    "answers": "EXTRACT_MODES extract_answer",
    "attention": "AttentionLayout EngineKVCache attention_forward attention_installed install_attention installable project_qkv",
    "chat_prompts": "decode_prompt tokenize_chat_prompt",
    "checkpoint_manager": "CheckpointManager SavedCheckpoint capture_training_state restore_training_state restored_rollouts",
    "checkpointer_facts": "epoch_output_dir hf_config model_type_name",
    "checkpointing": "RECIPE_STATE_FILE begin_step_dir checkpoint_retention complete_step_dirs find_latest_checkpoint model_files prune_step_dirs publish_step_dir recover_interrupted_saves restart_lr_schedule save_failure step_dir step_dirs",
    "code_tests": "normalize_tests",
    "collectives": "Collectives",
    "config": "DYNAMIC_SAMPLING_KEYS KL_PLACEMENTS KNOWN_KEYS LORA_KEYS LoRARecipeConfig MULTI_TURN_KEYS NUMERIC_RULES NumericRule REQUIRED_KEYS RecipeConfig build_multi_turn instantiate_component validate_config",
    "config_checks": "NumericRule numeric_rules required_keys validate_config",
    "config_docs": "DOC_TABLES render update_docs",
    "config_fields": "COMPONENT ConfigSchema LIST SECTION Setting component setting settings",
    "config_schema": "DynamicSamplingConfig GenerationWorkersConfig KL_PLACEMENTS LoRARecipeConfig MultiTurnConfig RecipeConfig",
    "crash_points": "CRASH_ENV crash_point",
    "diagnostics": "StepDiagnostics advantage_sums",
    "dynamic_sampling": "DynamicSampling GroupSelection",
    "evaluation": "EvalSums HeldOutEvaluation correctness_name evaluate pass_at_k",
    "experience": "BuiltExperience ExperienceBuilder Reference",
    "logprobs": "TokenLogprobs chunked_logprobs replace_unembed sequence_logprobs",
    "lora": "ADAPTER_CONFIG_FILE ADAPTER_PEFT_FILE ADAPTER_TORCHTUNE_FILE LoRAHyperparams load_nf4_base_weights lora_hyperparams nf4_parameters peft_adapter_config peft_adapter_weights read_hf_config save_adapter",
    "lora_setup": "build_lora_model",
    "loss_masks": "LossMaskOutput LossMasks",
    "metric_sums": "Key Mean Reduce Std StepSums Value one_process_sum reduce_over_ranks",
    "micro_batching": "MicroBatchPlan agreed_counts agreed_plan count_histogram plan_micro_batches",
    "model_setup": "Placement build_model check_max_seq_len init_rope",
    "nonfinite": "NONFINITE_POLICIES NonFiniteError advice check_policy count_nonfinite",
    "offpolicy": "CORRECTION_LEVELS CORRECTION_METRICS CORRECTION_MODES CorrectionOutput RolloutCorrection correction_metrics logprob_mismatch_sum off_policy_note tis_weights",
    "output_lock": "LOCK_FILE OutputDirBusy OutputDirLock",
    "packed_rows": "PACKED_ATTENTION PackedLayout PackedMask first_fit_decreasing flex_packed_attention packed_layout",
    "plotting": "plot_run read_metrics",
    "precision": "PRECISIONS Precision",
    "preemption": "SIGTERM_EXIT_CODE StopOnSigterm",
    "producer": "FixedRollouts PromptStream RolloutProducer",
    "quiet": "NOISE",
    "rejection_sampling": "RejectionStats rejection_sample write_jsonl",
    "resume": "BROKEN_CHECKPOINT_POLICIES ResumePoint config_changes earlier_run_note load_resume_point save_start_config",
    "rollout": "RolloutGroups sample_and_score",
    "rollout_worker": "WorkerSpec behaviour_logprobs main worker_main",
    "run_logs": "JsonlWriter RunLogs rewind_jsonl",
    "setup_checks": "check_device check_output_dir check_state_dict_shapes training_layout",
    "sharding": "shard_model unsharded",
    "step_metrics": "EPISODE_METRICS LOSS_METRICS declared_metrics rollout_sums sample_records step_metrics step_sums train_step_metrics",
    "token_selection": "HighEntropyTokens",
    "train_step": "GRPOStep StepResult count_nonfinite_weights staleness_metrics staleness_sums trained_parameters",
    "training_batch": "SharedPromptMask TrainingBatch install_shared_prompt_attention pack_sequences response_values shared_prompt_layout shared_prompt_unsupported shared_row_length supports_shared_prompt",
    "update": "Experience PolicyUpdate UpdateStats batch_logprobs batch_token_logprobs micro_batches",
    "waits": "REPORT_EVERY WaitReport",
    "worker_channel": "AUTHKEY_ENV ConnectionQueue authkey connect parse_address serve",
    "worker_rollouts": "WorkerError WorkerRollouts",
}


def _modules() -> Dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(name: str, path: Path, modules: Set[str]) -> Iterator[str]:
    """The package's modules that ``path`` imports anywhere in its source (module level or in functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from a import b`` imports the module a.b when there is one, else a name of a.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports."""
    modules = _modules()
    return {name: set(_imported(name, path, set(modules))) for name, path in modules.items()}


def folder_graph(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """Top-level entry (a folder or a top-level module) -> the other top-level entries it imports."""

    def entry(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: Dict[str, Set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(entry(module), set()).update(entry(t) for t in targets if entry(t) != entry(module))
    return out


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm): each is a circle."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_between_modules():
    assert circles(import_graph()) == []


def test_no_import_circles_between_folders():
    assert circles(folder_graph(import_graph())) == []


def test_the_circle_finder_finds_lazy_imports():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = ast.parse("def f():\n    from torchtune_grpo.training import update\n")
    assert isinstance(next(n for n in ast.walk(source) if isinstance(n, ast.ImportFrom)), ast.ImportFrom)


def test_top_level_is_short_and_has_no_grab_bag():
    entries = sorted(
        p.name for p in PACKAGE.iterdir() if not p.name.startswith(("_", ".")) and (p.is_dir() or p.suffix == ".py")
    )
    assert len(entries) <= MAX_TOP_LEVEL, entries
    assert not {"utils", "utils.py", "common", "misc", "helpers"} & set(entries)
    for entry in entries:
        assert entry == "cli.py" or (PACKAGE / entry / "__init__.py").exists(), entry


def test_the_recipe_class_stays_short():
    source = REPO / "recipes" / "grpo_full_finetune_distributed.py"
    classes = {n.name: n for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef)}
    recipe = classes["GRPOFullFinetuneRecipeDistributed"]
    lines = recipe.end_lineno - recipe.lineno + 1
    assert lines < MAX_RECIPE_CLASS_LINES, f"{source.name}: the recipe class has {lines} lines"


def _component_paths() -> Dict[str, Set[str]]:
    """Every ``_component_`` dotted path in the shipped configs, the docs and the README -> where it is."""
    files = sorted((REPO / "configs").rglob("*.yaml")) + sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
    pattern = re.compile(r"_component_\s*[:=]\s*[\"']?((?:torchtune_grpo|torchtune|torch)(?:\.\w+)+)")
    out: Dict[str, Set[str]] = {}
    for path in files:
        for match in pattern.finditer(path.read_text()):
            out.setdefault(match.group(1), set()).add(str(path.relative_to(REPO)))
    return out


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is not None and not dotted.startswith(e.name):
                raise  # a dependency of the module is missing, not the module
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_component_path_in_configs_and_docs_resolves_without_a_deprecation():
    paths = _component_paths()
    assert len(paths) > 20, "the search for _component_ paths found too few"
    for dotted, where in sorted(paths.items()):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            try:
                obj = _resolve(dotted)
            except ImportError as e:
                if type(e).__name__ == "MissingExtraError":  # an optional extra (envs/) that is not installed
                    continue
                raise AssertionError(f"{dotted} ({', '.join(sorted(where))}) does not import: {e}") from e
        assert callable(obj), f"{dotted} ({', '.join(sorted(where))}) is not callable"


def _forget(old: str) -> None:
    """Drop an old name from ``sys.modules`` and from its package, so that importing it finds it again."""
    sys.modules.pop(old, None)
    package = sys.modules["torchtune_grpo"]
    if hasattr(package, old.rpartition(".")[2]):
        delattr(package, old.rpartition(".")[2])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_works_and_names_the_new_one(old):
    full, new = f"torchtune_grpo.{old}", f"torchtune_grpo.{MOVED[old]}"
    _forget(full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(full)
        names = OLD_PUBLIC_NAMES[old].split()
        values = {name: getattr(module, name) for name in names}
    assert moved_message(full, new) in [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    current = importlib.import_module(new)
    for name, value in values.items():
        if name in MOVED_NAMES.get(old, {}):
            assert value is getattr(importlib.import_module(f"torchtune_grpo.{MOVED_NAMES[old][name]}"), name)
        else:
            assert value is getattr(current, name), f"{full}.{name}"
    if old not in MOVED_NAMES:
        assert module is current  # one module under two names: classes and state are shared
        assert current.__spec__.name == new


def test_every_old_module_is_in_the_table():
    assert set(OLD_PUBLIC_NAMES) - {"config"} == set(MOVED)
    for old, new in MOVED.items():
        assert not (PACKAGE / f"{old}.py").exists(), f"a file is left at the old path {old}.py"
        assert (PACKAGE / (new.replace(".", "/") + ".py")).exists(), new


def test_config_keeps_its_public_names():
    import torchtune_grpo.config as config

    for name in OLD_PUBLIC_NAMES["config"].split():
        assert hasattr(config, name), name


@pytest.mark.parametrize("old,new", [("rollout_worker", "workers.process"), ("config", "config")])
def test_python_dash_m_of_old_and_new_paths(old, new):
    proc = subprocess.run(
        [sys.executable, "-m", f"torchtune_grpo.{old}", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    if old != new:
        assert moved_message(f"torchtune_grpo.{old}", f"torchtune_grpo.{new}") in proc.stderr
