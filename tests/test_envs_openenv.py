"""OpenEnv adapter against real local OpenEnv servers (uvicorn processes started by the tests, no mocks).

A server written here (``faulty_env``) answers by the action's text: ``hang`` never answers in time, ``bad``
returns an observation without its text, ``die`` kills the server mid-episode, anything else ends the episode
with reward 1. Each failure must end only its episode, with an error the rollout counts, never raise into the
run. Needs the openenv extra (tests/extras.py: CI installs it; a missing extra fails, never skips).
"""

import math
import os
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests._env_runs import check_resume_equals_uninterrupted, check_two_processes
from tests.conftest import REPO
from tests.extras import extra_pythonpath, use_extra
from tests.recipe_utils import launch_command, read_jsonl, run_tune

from torchtune_grpo.envs import EpisodeInfoReward, OpenEnvEnvironment, openenv_dataset  # openenv on first use
from torchtune_grpo.envs import _openenv  # its server registry, to stop a server on purpose
from torchtune_grpo.multiturn import start_episodes, step_episodes
from torchtune_grpo.rewards import RewardSample


@pytest.fixture(scope="module", autouse=True)
def _openenv_extra():
    """The openenv extra, imported when this file's tests run, not when pytest collects them: each xdist worker
    collects every file, and importing OpenEnv's server stack (fastapi, fastmcp, uvicorn, ...) takes ~2 s."""
    use_extra("openenv")

FAULTY_ENV = '''
import os, time
from typing import Optional
from openenv.core import Action, Environment, Observation, State, create_app

class Act(Action):
    message: str

class Obs(Observation):
    message: Optional[str] = None

class Faulty(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Obs(message=f"problem {seed}")

    def step(self, action, timeout_s=None, **kwargs):
        if action.message == "hang":
            time.sleep(30)
        if action.message == "bad":
            return Obs(message=None, reward=0.0)
        if action.message == "die":
            os._exit(3)
        if action.message == "again":
            return Obs(message="once more", reward=0.25)
        return Obs(message="ok", reward=1.0, done=True)

    @property
    def state(self):
        return self._state

app = create_app(Faulty, Act, Obs, env_name="faulty", max_concurrent_envs=64)
'''


@pytest.fixture
def faulty_app(tmp_path, monkeypatch):
    (tmp_path / "faulty_env.py").write_text(FAULTY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))  # local_server passes sys.path to the server process
    app = "faulty_env:app"
    yield app
    proc = _openenv._servers.pop(app, None)
    if proc is not None and proc.poll() is None:
        proc.kill()


def _say(text):
    return {"role": "assistant", "content": text}


def test_episodes_against_a_real_server(faulty_app):
    env = OpenEnvEnvironment(app=faulty_app, message_timeout=2.0)
    starts = start_episodes(env, [{"seed": 5}, {"seed": 6}], timeout=30)
    assert [o.error for o in starts] == ["", ""]
    a, b = [o.value for o in starts]
    first = step_episodes(env, [a, b], [_say("again"), _say("42")], timeout=30)
    assert first[0].value.messages == [{"role": "user", "content": "once more"}] and not first[0].value.done
    assert first[0].value.info == {"env_reward": 0.25, "env_steps": 1}
    assert first[1].value.done and first[1].value.info["env_reward"] == 1.0
    second = step_episodes(env, [a], [_say("fine")], timeout=30)
    assert second[0].value.done and env.failures == 0


def test_timeout_and_malformed_observation_end_only_their_episode(faulty_app, caplog):
    env = OpenEnvEnvironment(app=faulty_app, message_timeout=1.0)
    states = [o.value for o in start_episodes(env, [{"seed": i} for i in range(3)], timeout=30)]
    t0 = time.monotonic()
    out = step_episodes(env, states, [_say("hang"), _say("bad"), _say("fine")], timeout=30)
    assert time.monotonic() - t0 < 10  # the hung step was given up after message_timeout, not waited for
    assert out[0].error.startswith("exception: OpenEnvTimeout") and "within 1.0 s" in out[0].error
    assert out[1].error.startswith("exception: ValueError: malformed OpenEnv observation after step")
    assert out[2].error == "" and out[2].value.done
    assert env.failures == 2 and caplog.text.count("OpenEnv episode ended by a failure") == 2


def test_server_death_mid_episode_is_a_counted_failure_then_restart(faulty_app):
    env = OpenEnvEnvironment(app=faulty_app, message_timeout=5.0)
    states = [o.value for o in start_episodes(env, [{"seed": 1}, {"seed": 2}], timeout=30)]
    first_url = env.base_url
    out = step_episodes(env, states, [_say("die"), _say("again")], timeout=30)
    # the step that killed the server fails; the other live episode loses its session too: errors, not exceptions
    assert out[0].error.startswith("exception:")
    proc = _openenv._servers[faulty_app]
    assert proc.wait(10) == 3
    after = step_episodes(env, [states[1]], [_say("fine")], timeout=30)
    assert after[0].error.startswith("exception:") or out[1].error.startswith("exception:")
    assert env.failures >= 2
    # the next rollout's episodes find the app's server dead: it is started again, on a new port
    again = start_episodes(env, [{"seed": 1}], timeout=60)
    assert again[0].error == "" and env.base_url != first_url
    assert step_episodes(env, [again[0].value], [_say("fine")], timeout=30)[0].value.done


def test_server_ends_with_a_process_that_exits_without_cleanup(faulty_app, tmp_path, monkeypatch):
    # the recipe's workers end with os._exit, which runs no atexit handler: the server must still go
    script = (
        "import os, sys\n"
        "from torchtune_grpo.envs import _openenv\n"
        f"_openenv.local_server({faulty_app!r})\n"
        f"print(_openenv._servers[{faulty_app!r}].pid, flush=True)\n"
        "os._exit(0)\n"
    )
    (tmp_path / "exits.py").write_text(script)
    # Forked from the tests' tune server (tests/_tune_server.py), which has imported torch and the package's data
    # modules that _openenv imports (~5-10 s in a fresh interpreter): a process of its own all the same, whose end
    # the server watches. Its PYTHONPATH adds only the openenv extra's folder (faulty_env is found next to the
    # script): a PYTHONPATH naming this process's whole sys.path (the standard library's folders among them) would
    # shadow what the server imported, and the command would run in a fresh interpreter (scripts/fork_stages.py).
    extra_pythonpath(monkeypatch, "openenv")
    command, env = launch_command([str(tmp_path / "exits.py")])
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), f"the OpenEnv server {pid} outlived its process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_reset_must_reproduce_the_prompt(faulty_app):
    env = OpenEnvEnvironment(app=faulty_app)
    ok, wrong = start_episodes(env, [{"seed": 4, "observation": "problem 4"}, {"seed": 4, "observation": "problem 5"}], 30)
    assert ok.error == ""
    assert "not reproducible" in wrong.error


def test_dataset_prompts_are_reset_observations(faulty_app, tokenizer):
    ds = openenv_dataset(tokenizer, num_episodes=3, seed=10, app=faulty_app, prompt_style="r1", max_prompt_length=None)
    assert [ds[i]["observation"] for i in range(3)] == ["problem 10", "problem 11", "problem 12"]
    assert [ds[i]["seed"] for i in range(3)] == [10, 11, 12]
    assert "problem 10" in ds[0]["prompt"]


def test_bundled_example_server():
    env = OpenEnvEnvironment(app="torchtune_grpo.envs.openenv_arithmetic:app")
    (state,) = [o.value for o in start_episodes(env, [{"seed": 7}], 60)]
    import random
    rng = random.Random(7)
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    wrong = step_episodes(env, [state], [_say(f"It is {a + b + 1}")], 30)[0].value
    assert not wrong.done and wrong.info["env_reward"] == 0.0
    right = step_episodes(env, [state], [_say(f"It is {a + b}")], 30)[0].value
    assert right.done and right.info["env_reward"] == 1.0
    reward = EpisodeInfoReward()
    assert reward.score_one(RewardSample("", "", [], {"episode": {"env_reward": 1.0}})) == 1.0
    with pytest.raises(ValueError, match="multi-turn"):
        reward.score_one(RewardSample("", "", [], {}))


def test_exactly_one_server_address():
    with pytest.raises(ValueError, match="exactly one of base_url"):
        OpenEnvEnvironment()
    with pytest.raises(ValueError, match="exactly one of base_url"):
        OpenEnvEnvironment(base_url="http://127.0.0.1:1", app="x:app")


@pytest.mark.parametrize("engine", ["vllm"])
def test_tiny_config_trains_against_the_bundled_server(tmp_path: Path, monkeypatch, engine: str):
    # Episodes go through the project's rollout, so any engine samples them (vLLM: re-sent histories). The
    # native engine's run of this config: test_resume_and_two_processes (its two-process `tune run`).
    extra_pythonpath(monkeypatch, "openenv")
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "openenv_cpu.yaml")
    cfg.output_dir = str(tmp_path / "out")
    cfg.max_steps, cfg.save_every_n_steps = 2, 2
    if engine == "vllm":
        cfg.generation = {"_component_": "torchtune_grpo.generation.VLLMGenerator", "model": "${checkpointer.checkpoint_dir}", "temperature": 1.0,
            "max_model_len": cfg.max_prompt_length + cfg.max_response_length, "kv_cache_memory_gib": 0.25}

    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path)
    run_tune(path, cwd=tmp_path)
    steps = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    for r in steps:
        assert r["reward/environment/errors"] == 0 and r["episode/turns"] >= 1
        assert "reward/correctness/mean" in r


@pytest.mark.slow
def test_resume_and_two_processes(tmp_path: Path, monkeypatch):
    # every process starts its own server for the app; a resumed run resets its episodes with the same seeds
    extra_pythonpath(monkeypatch, "openenv")
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "openenv_cpu.yaml")
    check_resume_equals_uninterrupted(cfg, tmp_path)
    # The shipped config through `tune run` with the native engine: trains against the bundled server.
    steps = check_two_processes(cfg, tmp_path)
    for r in steps:
        assert r["reward/environment/errors"] == 0 and r["episode/turns"] >= 1
        assert "reward/correctness/mean" in r
