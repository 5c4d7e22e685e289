"""More helpers for in-process recipe tests (tests/recipe_utils.py has the basic ones)."""

import os
from pathlib import Path

from omegaconf import OmegaConf

from tests.recipe_utils import run_in_process


def with_overrides(config_path: Path, **overrides) -> Path:
    """Apply ``overrides`` (dotted keys) to the config file in place, as `tune run ... key=value` would."""
    cfg = OmegaConf.load(config_path)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    OmegaConf.save(cfg, config_path)
    return config_path


def run_in_process_isolated(config_path: Path, *, lora: bool = False):
    """:func:`tests.recipe_utils.run_in_process`, with the environment restored afterwards, so that several
    in-process runs in one test each start as a fresh `tune run` would (the recipe sets RANK, WORLD_SIZE and
    MASTER_* for its one-process group and destroys the group in ``cleanup``)."""
    saved = dict(os.environ)
    try:
        return run_in_process(config_path, lora=lora)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_in_process_logged(config_path: Path, *, lora: bool = False) -> str:
    """:func:`run_in_process_isolated` for module-scoped fixtures (which cannot use the function-scoped
    ``clean_env`` and ``one_thread``): one intra-op thread, the environment and process group restored, and
    the run's INFO log records returned as text (what `tune run` would print)."""
    import logging

    import torch
    import torch.distributed as dist

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    root = logging.getLogger()
    threads = torch.get_num_threads()
    root.addHandler(handler)
    torch.set_num_threads(1)
    try:
        run_in_process_isolated(config_path, lora=lora)
    finally:
        torch.set_num_threads(threads)
        root.removeHandler(handler)
        if dist.is_initialized():
            dist.destroy_process_group()
    return "\n".join(records)


def init_one_process_group() -> None:
    """A one-process gloo group in this process, as the recipe makes on one process (pair with the
    ``clean_env`` fixture, which destroys it and restores RANK/WORLD_SIZE/MASTER_*)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
