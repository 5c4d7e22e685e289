"""No silent waits: every wait of a run that can last longer than half a minute says what it waits for, and a
listed address where nothing listens, or a worker that stops answering, is named at once or at its limit.

- :class:`~torchtune_grpo.runtime.waits.WaitReport` on a hand-driven clock: when it speaks and what it says;
- a listed vLLM server address where nothing listens fails in seconds (not ``startup_timeout``) naming the
  key and the address; a server still loading is reported while it is waited for;
- a generation worker that stops answering, local (SIGSTOPped) or remote (a listener that takes the spec and
  never replies), stops the run naming the worker, its pid or address, how long it waited and the limit,
  after reports of the wait.
"""

import http.server
import inspect
import logging
import os
import re
import signal
import threading
import time
from multiprocessing.connection import Listener

import pytest
from omegaconf import OmegaConf

from tests.conftest import free_port
from tests.recipe_utils import recipe_in_process, run_in_process, write_config
from torchtune_grpo.runtime import waits
from torchtune_grpo.assets import asset_path
from torchtune_grpo.generation import VLLMServerError, VLLMServerGenerator
from torchtune_grpo.generation._vllm_server_process import REFUSED_FOR, VLLMServer
from torchtune_grpo.workers.channel import AUTHKEY_ENV
from torchtune_grpo.workers.client import WorkerError

SECRET = "test-secret"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_is_reported_every_interval_with_what_how_long_and_the_limit():
    clock, said = _Clock(), []
    report = waits.WaitReport("the server", limit=600, limit_key="generation.startup_timeout", every=30,
                              say=said.append, clock=clock)
    for now, expected in [(129.9, 0), (130.0, 1), (140.0, 1), (159.9, 1), (160.0, 2)]:
        clock.now = now
        report()
        assert len(said) == expected, (now, said)
    assert said == [
        "still waiting for the server: 30 s so far (limit 600 s, generation.startup_timeout)",
        "still waiting for the server: 60 s so far (limit 600 s, generation.startup_timeout)",
    ]
    # After a blocking call that missed several intervals: one report, the next one a full interval later.
    clock.now = 250.0
    report()
    clock.now = 279.0
    report()
    assert said[2:] == ["still waiting for the server: 150 s so far (limit 600 s, generation.startup_timeout)"]
    unlimited = waits.WaitReport("a reward", say=said.append, clock=clock, every=30)
    clock.now += 30
    unlimited()
    assert said[-1] == "still waiting for a reward: 30 s so far (no limit)"


def test_a_blocking_wait_is_reported_from_a_thread():
    spoke = threading.Event()
    said = []

    def say(message):
        said.append(message)
        if len(said) == 2:
            spoke.set()

    with waits.WaitReport("a blocking call", every=0.05, say=say).watch():
        assert spoke.wait(30)  # the block ends once two reports came (or fails after 30 s)
    count = len(said)
    threading.Event().wait(0.2)
    assert len(said) == count  # the thread stopped with the block
    assert all(m.startswith("still waiting for a blocking call: ") for m in said)


def _log_of(logger_module):
    """Messages of the (torchtune) logger ``logger_module.log`` while the test runs."""
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger_module.log.addHandler(handler)
    return messages, lambda: logger_module.log.removeHandler(handler)


def test_a_listed_server_address_where_nothing_listens_is_named_in_seconds(monkeypatch):
    # startup_timeout keeps its default (600 s): a refused connection must not be waited for that long.
    # The refused-for limit is the default of VLLMServer.connect's ``refused_for`` (REFUSED_FOR, 5 s), which the
    # generator leaves alone: waiting those 5 s out would only show a sleep. The test checks that default, then
    # lets connect stop after 0.5 s of refusals (still 5 health checks, one every 0.1 s), through a wrapper that
    # adds the keyword: were the generator to pass its own refused_for (its startup_timeout, say), the call
    # would fail with a duplicate keyword and so would this test.
    assert inspect.signature(VLLMServer.connect).parameters["refused_for"].default == REFUSED_FOR == 5.0
    connect = VLLMServer.connect.__func__
    monkeypatch.setattr(VLLMServer, "connect",
                        classmethod(lambda cls, address, **kwargs: connect(cls, address, refused_for=0.5, **kwargs)))
    port = free_port()
    engine = VLLMServerGenerator(model=str(asset_path("tiny_qwen2_arith")), servers=[f"127.0.0.1:{port}"])
    errors = []

    def open_server():
        try:
            engine.server
        except VLLMServerError as error:
            errors.append(str(error))

    thread = threading.Thread(target=open_server, daemon=True)
    thread.start()
    # Refused connections end the wait after refused_for (0.5 s here); 60 s only bounds a hang of the test.
    thread.join(60)
    assert not thread.is_alive(), "a refused address was waited for like a starting server"
    assert errors and errors[0].startswith(
        f"generation.servers[0]: nothing listens at http://127.0.0.1:{port}: connections refused for 0.5 s"
    ), errors


def test_a_listed_server_that_is_still_loading_is_waited_for_and_reported(monkeypatch):
    monkeypatch.setattr(waits, "REPORT_EVERY", 0.2)
    # "Loading" (503) for 0.5 s after the first health check, then healthy: the wait passes REPORT_EVERY (0.2 s)
    # before it ends, so it is reported at least once, whatever the interval between checks (0.1 s now). A time,
    # not a number of 503s: a faster poll must not end the wait before the report is due.
    started: list = []  # the first check's time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            started[:] = started or [time.monotonic()]
            self.send_response(503 if time.monotonic() - started[0] < 0.5 else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    messages, detach = _log_of(waits)
    try:
        engine = VLLMServerGenerator(model=str(asset_path("tiny_qwen2_arith")),
                                     servers=[f"127.0.0.1:{httpd.server_port}"])
        assert engine.server.url == f"http://127.0.0.1:{httpd.server_port}"
    finally:
        detach()
        httpd.shutdown()
    reports = [m for m in messages if m.startswith("still waiting for the vLLM server at http://127.0.0.1:")]
    assert reports and all("to answer /health" in m and "limit 600 s, generation.startup_timeout" in m
                           for m in reports), messages


def _config(directory, **workers):
    # More steps than the run reaches: the silent worker must be what ends it.
    directory.mkdir()
    return write_config(directory, max_steps=8, save_every_n_steps=None,
                        generation_workers={"enabled": True, "max_staleness": 1, "restarts": 0, **workers})


def test_a_local_worker_that_stops_answering_is_named_with_its_wait(tmp_path, clean_env, one_thread, monkeypatch):
    # The worker stays alive and connected, but a reward hangs in it (while the file exists): it stops answering.
    monkeypatch.setattr(waits, "REPORT_EVERY", 0.25)
    hang = tmp_path / "hang"
    config = _config(tmp_path / "run", timeout=120)
    cfg = OmegaConf.load(config)
    cfg.reward_functions.append({"_component_": "tests._rewards.HangWhileFileExists", "path": str(hang), "weight": 1.0})
    OmegaConf.save(cfg, config)
    log: list = []
    # Starting a worker takes seconds on a loaded machine: the short limit is set once it answers.
    with recipe_in_process(config, log=log) as recipe:
        recipe.train_step()
        recipe.step.rollouts.timeout = 1.0  # four report intervals: the wait is reported before it runs out
        pid = recipe.step.rollouts.pid
        hang.touch()
        try:
            with pytest.raises(WorkerError) as error:
                recipe.train()
        finally:
            os.kill(pid, signal.SIGKILL)  # not left to close()'s 30 s of waiting for a goodbye
    # The wait is said in whole seconds: 1, or more where a loaded machine wakes the trainer late.
    who = re.escape(f"generation worker of rank 0 (pid {pid})")
    assert re.search(rf"{who} sent nothing for [1-9] s \(limit 1 s, generation_workers.timeout\)", str(error.value))
    assert "generation_workers.restarts = 0 used up" in str(error.value)
    # Reports of the wait that ran out (the worker's start was reported too, under its 120 s limit).
    assert any(m.startswith("still waiting for a reply from the generation worker of rank 0: ")
               and m.endswith(" s so far (limit 1 s, generation_workers.timeout)") for m in log), log


def test_a_remote_worker_that_never_answers_is_named_with_its_address(tmp_path, clean_env, one_thread, monkeypatch):
    # A listener that authenticates the trainer and takes its spec, then says nothing (a hung worker node).
    monkeypatch.setenv(AUTHKEY_ENV, SECRET)
    monkeypatch.setattr(waits, "REPORT_EVERY", 0.25)
    listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=SECRET.encode())
    port = listener.address[1]
    taken = []

    def hang():
        conn = listener.accept()
        taken.append(conn.recv_bytes())  # the spec
        threading.Event().wait(60)  # holds the connection open, silent

    threading.Thread(target=hang, daemon=True).start()
    log: list = []
    try:
        with pytest.raises(WorkerError) as error:
            # timeout 1 s: four report intervals, so the wait is reported before it runs out
            run_in_process(_config(tmp_path / "run", timeout=1, addresses=[f"127.0.0.1:{port}"]), log=log)
    finally:
        listener.close()
    assert taken, "the trainer never sent its spec"
    who = re.escape(f"generation worker of rank 0 at 127.0.0.1:{port} (generation_workers.addresses[0])")
    assert re.search(rf"{who} sent nothing for [1-9] s \(limit 1 s, generation_workers.timeout\)", str(error.value))
    assert any(m.startswith(f"still waiting for a reply from the generation worker of rank 0 at 127.0.0.1:{port}")
               for m in log), log
