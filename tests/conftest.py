"""Shared fixtures: a tiny torchtune decoder built in code, paths to the shipped tiny config, one intra-op
thread, and an environment restored after an in-process recipe."""

import importlib.util
import json
import os
import re
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest
import torch
from torchtune.models.qwen2 import qwen2

REPO = Path(__file__).resolve().parents[1]


def load_benchmark(name: str, module_name: Optional[str] = None) -> ModuleType:
    """``benchmarks/NAME.py`` as a module, imported the way ``python benchmarks/NAME.py`` runs it: with
    ``benchmarks/`` on ``sys.path`` (its shared ``harness`` and the other benchmark modules import from there).
    Registered in ``sys.modules`` (as ``module_name``, default ``NAME``): components it defines are
    instantiated by dotted path."""
    directory = str(REPO / "benchmarks")
    if directory not in sys.path:
        sys.path.append(directory)  # after the repository: ``tests``/``torchtune_grpo`` resolve as before
    spec = importlib.util.spec_from_file_location(module_name or name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
TINY_CONFIG = REPO / "configs" / "tiny" / "full_grpo_cpu.yaml"


def _reasoning_gym_on_path() -> None:
    # Shipped configs use reasoning-gym components (tests/test_configs.py builds their rewards) and it
    # conflicts with nothing, so its extra's folder is on every test's path (tests/extras.py).
    from tests.extras import add_to_path

    add_to_path("reasoning-gym")


_reasoning_gym_on_path()

# One intra-op thread for every test in this process, as the recipe's subprocess runs get (OMP_NUM_THREADS=1,
# tests/recipe_utils.py tune_env). The suite's tensors are tiny: with torch's default pool (one thread per core)
# on a few busy cores (xdist workers, other jobs), each op waits on the pool's synchronisation and tiny ops run
# 10-100x slower (tests/test_generation_compact.py: 32.6 s -> 1.5 s per case on 2 loaded cores). No result
# changes: every comparison in the suite is between computations in one process or against subprocesses that
# already run on one thread. Tests that need another count set it and restore it (the ``one_thread`` fixture,
# tests/test_benchmarks.py, tests/test_backends_benchmark.py). vLLM's tests run their engines in subprocesses.
torch.set_num_threads(1)


def make_tiny_decoder(seed: int = 0, vocab_size: int = 97, scale: float = 4.0):
    """A 2-layer Qwen2-shaped decoder with weights scaled up so greedy outputs vary by prompt."""
    torch.manual_seed(seed)
    model = qwen2(
        vocab_size=vocab_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=256,
        tie_word_embeddings=True,
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tiny Qwen2 byte-level BPE tokenizer (torchtune's ``qwen2_5_tokenizer``)."""
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    from torchtune_grpo.assets import asset_path

    return qwen2_5_tokenizer(
        path=asset_path("tiny_qwen2", "vocab.json"),
        merges_file=asset_path("tiny_qwen2", "merges.txt"),
        special_tokens_path=asset_path("tiny_qwen2", "tokenizer.json"),
    )


@pytest.fixture(scope="module")
def family_policy():
    """``family_policy(family)``: the family's tiny model of tests/hf_families.py or tests/hf_moe.py (seed 0, peaked
    attention, decisive routers) as the recipe's :class:`~torchtune_grpo.models.TransformersDecoder`, built once per
    module (imported here, not at the top: only the transformers tests need transformers)."""
    from tests.hf_families import family_model
    from torchtune_grpo.models import TransformersDecoder

    built = {}

    def get(family: str) -> TransformersDecoder:
        if family not in built:
            built[family] = TransformersDecoder(family_model(family), 256, {})
        return built[family]

    return get


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jsonl(path: Path, rows) -> str:
    """Write ``rows`` (dicts) as a JSONL file; returns its path as a string."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def vision_dir(tmp_path_factory):
    """``vision_dir(family)``: the tiny multimodal directory of ``family`` with its image processor and chat
    template (:func:`tests.hf_vision.make_vision_dir`), built once per session (per test file under xdist)."""
    from tests.hf_vision import make_vision_dir

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = make_vision_dir(family, tmp_path_factory.mktemp(f"vision_{family}"))
        return built[family]

    return get


@pytest.fixture
def tiny_decoder():
    return make_tiny_decoder()


@pytest.fixture
def one_thread():
    """One intra-op thread, as the subprocess runs get (OMP_NUM_THREADS=1): with a few busy cores, the
    default thread pool makes tiny ops 10-100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def clean_env():
    """An in-process recipe sets RANK/WORLD_SIZE for its one-process group: restore the environment and destroy
    the group afterwards."""
    import torch.distributed as dist

    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


# The order files are handed out in under pytest-xdist (`make test`: -n auto --dist loadfile
# --no-loadscope-reorder gives whole files to whichever worker is free, in collection order): longest first, by
# the seconds docs/test_durations.md measured for each file, so that no long file starts late and runs alone on
# one core at the end (longest-processing-time-first, within a few percent of the best order for 2 workers).
# A file the table does not have yet goes with the files of UNMEASURED_SECONDS if it has multi-process (`slow`)
# tests, else last; regenerating the table (docs/test_durations.md says how) places it.
DURATIONS_TABLE = Path(__file__).resolve().parent.parent / "docs" / "test_durations.md"
UNMEASURED_SECONDS = {True: 10.0, False: 0.0}


def measured_seconds(table: Path = DURATIONS_TABLE) -> dict:
    """Each test file's worker-seconds from the table of docs/test_durations.md (empty where it is missing).

    Returns:
        dict: file name (``test_x.py``) -> seconds.
    """
    if not table.is_file():
        return {}
    rows = re.findall(r"^\| `tests/([^`]+\.py)` \| \d+ \| ([0-9.]+) \|", table.read_text(), re.MULTILINE)
    return {name: float(seconds) for name, seconds in rows}


def pytest_addoption(parser):
    parser.addoption(
        "--device", default=None, choices=["cuda", "cpu"],
        help="run the `gpu` tests (tests/test_gpu.py) on this device; cpu is their rehearsal "
        "(scripts/gpu_check.sh --device cpu). Without it they run where CUDA is available and are "
        "deselected elsewhere.",
    )


def gpu_tests_device(config) -> "str | None":
    """The device the `gpu` tests run on: ``--device``, else cuda when available, else None (deselected)."""
    chosen = config.getoption("--device")
    if chosen:
        return chosen
    return "cuda" if torch.cuda.is_available() else None


def pytest_report_header(config):
    device = gpu_tests_device(config)
    return f"gpu tests: {'on ' + device if device else 'deselected (no CUDA; --device cpu rehearses them)'}"


@pytest.fixture
def gpu_device(request) -> torch.device:
    """The device of a `gpu` test (see ``--device``)."""
    return torch.device(gpu_tests_device(request.config))


def pytest_collection_modifyitems(config, items):
    """Deselect the `gpu` tests where they have no device; order files longest first (a stable sort:
    tests keep their order within a file).

    The `gpu` tests are deselected, not skipped, without CUDA and without ``--device``: the CPU suite
    (``make test``, CI) never runs them on a device they were not written for, and does not report them as
    passed; their CPU rehearsal runs them with ``--device cpu`` (tests/test_gpu_check.py).
    """
    if gpu_tests_device(config) is None:
        gpu = [item for item in items if item.get_closest_marker("gpu")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    seconds = measured_seconds()

    def rank(item) -> float:
        name = item.path.name
        return -seconds.get(name, UNMEASURED_SECONDS[item.path in slow_files])

    items.sort(key=rank)
