"""Several recipe runs in ONE launch of two spawned processes, instead of one ``tune run`` per run.

A ``tune run --nproc_per_node 2`` costs three interpreter start-ups (the launcher and two ranks, each importing
torch, torchtune and the recipe) before its first step; tests that compare many runs pay that once here. The two
processes first run the one-process runs side by side (each in its own one-process group, the runs dealt out in
turn), then every two-process run together, each through the recipe class as ``tune run`` would drive it
(:func:`tests.recipe_utils.run_in_process`). Each run's INFO log messages (what ``tune run`` prints) are written
next to its config, ``run.rank{R}.log`` for its rank ``R`` in the run's own group, for the tests to read.
A few tests keep the real ``tune run`` end to end (tests/test_distributed_runs.py, tests/test_recipe.py).
"""

import os
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import torch

from tests.conftest import free_port
from tests.recipe_utils import run_in_process


class Run(NamedTuple):
    """One launch's share of work: a two-process run and/or a one-process run (config paths).

    Attributes:
        two_processes (Optional[str]): a config run on both processes together. Default is None.
        one_process (Optional[str]): a config run on one process alone (its reference, usually). Default is None.
        lora (bool): the LoRA recipe instead of the full one. Default is False.
    """

    two_processes: Optional[str] = None
    one_process: Optional[str] = None
    lora: bool = False


def log_of(config: os.PathLike, rank: int = 0) -> str:
    """The INFO log messages rank ``rank`` of the run of ``config`` wrote (:func:`launch`)."""
    return (Path(config).parent / f"run.rank{rank}.log").read_text()


def _run(config: str, lora: bool) -> None:
    messages: List[str] = []
    try:
        run_in_process(Path(config), lora=lora, log=messages)
    finally:  # a failed run's log helps its traceback
        rank = int(os.environ["RANK"])
        (Path(config).parent / f"run.rank{rank}.log").write_text("\n".join(messages) + "\n")


def _rank_main(rank: int, runs: List[Run], store_port: int) -> None:
    """One of the two spawned processes: its share of the one-process runs, then every two-process run."""
    import faulthandler
    import logging

    import torch.distributed as dist

    # A rank that dies on a signal (gloo aborts with SIGABRT) prints every thread's Python stack: where it was.
    faulthandler.enable()
    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.INFO)  # the recipe's INFO messages reach the log handler
    # The parent's store hands rank 1 the port rank 0 picked just before each two-process run (ports picked
    # ahead of time could be taken by then on a busy machine).
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    singles = [r for r in runs if r.one_process is not None]
    for i, r in enumerate(singles):
        if i % 2 == rank:
            os.environ.pop("MASTER_PORT", None)  # the recipe picks a free one for its one-process group
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
            _run(r.one_process, r.lora)
    for i, r in enumerate(runs):
        if r.two_processes is None:
            continue
        if rank == 0:
            store.set(f"port/{i}", str(free_port()))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=store.get(f"port/{i}").decode(), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        _run(r.two_processes, r.lora)
    # All output is written and every process group destroyed: leave before interpreter teardown, where gloo
    # occasionally aborts (DESIGN.md). An exception above never gets here and fails the spawn with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(runs: List[Run]) -> None:
    """Run ``runs`` in one launch of two processes; returns when both exited 0, raises with the traceback of a
    process that failed (``torch.multiprocessing.spawn`` stops the other)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # on a port the OS picks
    mp.spawn(_rank_main, args=(runs, store.port), nprocs=2, join=True)
