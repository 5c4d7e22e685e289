"""Generation workers on other nodes (torchtune_grpo/workers/channel.py): a worker started on its own with
``python -m torchtune_grpo.workers.process --listen HOST:PORT`` serves a trainer over TCP exactly as a local
worker process does, survives being restarted mid-run (the trainer reconnects and the run ends unchanged),
and every misconfiguration stops the run at setup naming the key or the variable."""

import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.conftest import free_port, REPO
from tests.recipe_utils import read_jsonl, recipe_in_process, run_in_process, tune_env, weights, write_config
from torchtune_grpo.runtime import waits
from torchtune_grpo.workers.channel import AUTHKEY_ENV
from torchtune_grpo.workers.client import WorkerError

COMPARED = ("reward/mean", "loss", "grad_norm", "kl", "entropy", "staleness/max", "generation/logprob_mismatch")
SECRET = "test-secret"


@contextmanager
def worker_server(port: int, secret: str = SECRET, log_dir: Optional[Path] = None):
    """A worker listening on 127.0.0.1:``port`` in a process of its own (as on another node), until the block
    ends; yields the process. Its output goes to a file (``log_dir``/worker_PORT.log), never to a pipe: a pipe
    that nobody reads fills after 64 KiB and then blocks the worker in its next print, silently."""
    log_path = Path(log_dir or tempfile.mkdtemp(prefix="grpo_worker_")) / f"worker_{port}.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchtune_grpo.workers.process", "--listen", f"127.0.0.1:{port}"],
            env=tune_env(**{AUTHKEY_ENV: secret}), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while f"generation worker listening on 127.0.0.1:{port}" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _continue_once_reported(server: subprocess.Popen, log: list, since: int, waiting: str) -> None:
    """SIGCONT the stopped ``server`` once a message of ``log`` after the first ``since`` starts with ``waiting``
    (the trainer has said it waits for it), or after 120 s (then the test's check of that message fails)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(m.startswith(waiting) for m in log[since:]):
        time.sleep(0.05)
    server.send_signal(signal.SIGCONT)


def _metrics(out: Path):
    return [{k: m[k] for k in COMPARED} for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def _config(directory: Path, **workers):
    directory.mkdir()
    return write_config(directory, max_steps=3, save_every_n_steps=None,
                        generation_workers={"enabled": True, "max_staleness": 1, **workers})


def test_a_worker_on_another_node_gives_the_local_workers_run_and_survives_a_restart(
    tmp_path, clean_env, one_thread, monkeypatch
):
    # One step off, 3 steps: a local worker process; the same worker served over TCP, stopped after step 1 until
    # the trainer has reported waiting for it (a slow node: the trainer waits, saying so, and goes on); and a
    # second run on that TCP worker, SIGKILLed after step 1 (batches in flight) and started again on the same
    # port: the trainer notices the closed connection, reconnects and re-sends what was not answered. All
    # three: the same numbers.
    monkeypatch.setenv(AUTHKEY_ENV, SECRET)
    # The trainer polls a remote worker's connection in slices of min(0.5 s, REPORT_EVERY) and reports a wait
    # every REPORT_EVERY: its first report means it sat through two empty slices, each once fatal (a reply slower
    # than one poll crashed the wait), without failing.
    monkeypatch.setattr(waits, "REPORT_EVERY", 1.0)
    run_in_process(_config(tmp_path / "local"))
    port = free_port()
    address = {"addresses": [f"127.0.0.1:{port}"]}
    waiting = f"still waiting for a reply from the generation worker of rank 0 at 127.0.0.1:{port}"
    log: list = []
    with worker_server(port, log_dir=tmp_path) as server:
        with recipe_in_process(_config(tmp_path / "remote", **address), log=log) as recipe:
            recipe.train_step()
            server.send_signal(signal.SIGSTOP)  # alive and connected, silent until the trainer says it waits
            threading.Thread(target=_continue_once_reported, args=(server, log, len(log), waiting), daemon=True).start()
            recipe.train()
        assert any(m.startswith(waiting) for m in log), log
        # The same worker serves the next trainer once the first one has left.
        with recipe_in_process(_config(tmp_path / "restarted", **address), log=log) as recipe:
            assert recipe.step.rollouts.pid is None  # nothing spawned here
            recipe.train_step()
            server.send_signal(signal.SIGKILL)
            server.wait()
            with worker_server(port, log_dir=tmp_path):
                recipe.train()
    assert any(f"generation worker of rank 0 at 127.0.0.1:{port} (generation_workers.addresses[0]) closed the "
               "connection (the worker died or was stopped): starting a new one (1 of 3 restarts)" in m for m in log), log
    local = _metrics(tmp_path / "local" / "out")
    assert [m["staleness/max"] for m in local] == [0, 1, 1]
    final = weights(tmp_path / "local" / "out" / "step_3")
    for name in ("remote", "restarted"):
        assert _metrics(tmp_path / name / "out") == local, name
        other = weights(tmp_path / name / "out" / "step_3")
        assert all(torch.equal(final[k], other[k]) for k in final), name


def test_worker_addresses_that_cannot_work_stop_the_run_at_setup_naming_the_key(tmp_path, clean_env, one_thread, monkeypatch):
    port = free_port()
    cases = [
        ({"addresses": ["localhost"]}, ValueError, r"generation_workers.addresses\[0\]: expected 'host:port'"),
        ({"addresses": ["127.0.0.1:1", "127.0.0.1:2"]}, ValueError,
         r"generation_workers.addresses has 2 entries for 1 trainer process\(es\)"),
        ({"addresses": [f"127.0.0.1:{port}"], "connect_timeout": 1}, WorkerError,
         rf"generation worker of rank 0 at 127.0.0.1:{port} \(generation_workers.addresses\[0\]\): nothing accepted a "
         r"connection for 1 s \(generation_workers.connect_timeout"),
    ]
    monkeypatch.setenv(AUTHKEY_ENV, SECRET)
    for i, (workers, error, message) in enumerate(cases):
        with pytest.raises(error, match=message):
            run_in_process(_config(tmp_path / str(i), **workers))
    monkeypatch.delenv(AUTHKEY_ENV)
    with pytest.raises(ValueError, match=rf"generation_workers.addresses\[0\]: set the environment variable {AUTHKEY_ENV}"):
        run_in_process(_config(tmp_path / "no_key", addresses=[f"127.0.0.1:{port}"]))
    monkeypatch.setenv(AUTHKEY_ENV, "another-secret")
    with worker_server(port):
        with pytest.raises(WorkerError, match=rf"refused the connection .*set the same {AUTHKEY_ENV} on both sides"):
            run_in_process(_config(tmp_path / "wrong_key", addresses=[f"127.0.0.1:{port}"]))
