"""Several recipe runs in ONE launch of two spawned processes, instead of one ``tune run`` per run.

A ``tune run --nproc_per_node 2`` costs three interpreter start-ups (the launcher and two ranks, each importing
torch, torchtune and the recipe) before its first step; tests that compare many runs pay that once here. The two
processes first run the one-process runs side by side (each in its own one-process group; each process takes the
next run in the list when it is free, so list the longest first), then every two-process run together, each through
the recipe class as ``tune run`` would drive it (:func:`tests.recipe_utils.run_in_process`). Each run's INFO log
messages (what ``tune run`` prints) are written next to its config, ``run.rank{R}.log`` for its rank ``R`` in the
run's own group, for the tests to read.
The two processes are forked from the tests' fork server (tests/_tune_server.py: a process that imported torch,
torchtune and the recipes once) instead of spawned (two fresh interpreters importing them: ~5 s before the first run).
A few tests keep the real ``tune run`` end to end (tests/test_distributed_runs.py, tests/test_recipe.py).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, NamedTuple, Optional

import torch

from tests.conftest import REPO
from tests.recipe_utils import launch_command, run_in_process


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
    """One of the launch's two processes: its share of the one-process runs, then every two-process run."""
    import faulthandler
    import logging

    import torch.distributed as dist

    # A rank that dies on a signal (gloo aborts with SIGABRT) prints every thread's Python stack: where it was.
    faulthandler.enable()
    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.INFO)  # the recipe's INFO messages reach the log handler
    # The parent's store hands rank 1 the port of the store rank 0 opened for each two-process run.
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    singles = [r for r in runs if r.one_process is not None]
    # Each process takes the next one-process run when it is free (the store's counter hands each index out
    # once), so a long run does not leave the other process idle behind a fixed share.
    while (i := store.add("next_single", 1) - 1) < len(singles):
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        _run(singles[i].one_process, singles[i].lora)
    run_stores = []  # kept open until the process leaves: a rank may still be tearing down its group
    for i, r in enumerate(runs):
        if r.two_processes is None:
            continue
        # Each two-process group meets on a store that is already listening, on a port the OS picked, as torchrun's
        # ranks meet on its agent's store (TORCHELASTIC_USE_AGENT_STORE: every rank a client of it). With rank 0
        # opening the store inside init_process_group instead, rank 1 often knocked before it listened and retried
        # after a back-off: ~0.2 s a run.
        if rank == 0:
            run_stores.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
            store.set(f"port/{i}", str(run_stores[-1].port))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=store.get(f"port/{i}").decode(), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          TORCHELASTIC_USE_AGENT_STORE="True")
        _run(r.two_processes, r.lora)
    # All output is written and every process group destroyed: leave before interpreter teardown, where gloo
    # occasionally aborts (DESIGN.md). An exception above never gets here and fails the spawn with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(runs: List[Run]) -> None:
    """Run ``runs`` in one launch of two processes; returns when both exited 0, raises with the output of a
    process that failed (its traceback; the other is stopped)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # on a port the OS picks
    with tempfile.TemporaryDirectory(prefix="spawn-runs-") as tmp:
        spec = Path(tmp) / "runs.json"
        spec.write_text(json.dumps([r._asdict() for r in runs]))
        procs, logs = [], []
        for rank in range(2):
            cmd, env = launch_command(["-m", "tests._spawn_runs", str(spec), str(rank), str(store.port)])
            logs.append(open(Path(tmp) / f"rank{rank}.out", "w+"))
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        try:
            while all(p.poll() is None for p in procs):
                time.sleep(0.05)
            failed = [(rank, p) for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
            if not failed:  # one exited 0: it finished every run, so the other has too, or fails on its own
                for p in procs:
                    p.wait(timeout=600)
                failed = [(rank, p) for rank, p in enumerate(procs) if p.returncode != 0]
            if failed:
                rank, proc = failed[0]
                logs[rank].seek(0)
                raise AssertionError(f"process {rank} of the launch exited {proc.returncode}:\n"
                                     + logs[rank].read()[-8000:])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()


if __name__ == "__main__":
    # python -m tests._spawn_runs RUNS_JSON RANK STORE_PORT: one of launch()'s two processes.
    _rank_main(int(sys.argv[2]), [Run(**r) for r in json.loads(Path(sys.argv[1]).read_text())], int(sys.argv[3]))
