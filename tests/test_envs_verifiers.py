"""verifiers adapter (verifiers 0.4, ``verifiers.v1``) with tasksets written here in verifiers' own classes.

The test tasksets are packages in a temporary folder, loaded by id as verifiers loads installed tasksets. Needs
the verifiers extra (tests/extras.py: CI installs it; a missing extra fails, never skips).
"""

import asyncio
import math
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests._env_runs import check_resume_equals_uninterrupted, check_two_processes
from tests.conftest import TINY_CONFIG
from tests.extras import extra_pythonpath, use_extra
from tests.recipe_utils import read_jsonl, run_in_process, run_tune

from torchtune_grpo.envs import (  # the adapters import verifiers on first use
    UnsupportedVerifiersFeature, VerifiersEnvironment, VerifiersReward, load_taskset, verifiers_dataset,
)
from torchtune_grpo.multiturn import start_episodes, step_episodes
from torchtune_grpo.rewards import RewardBatch, RewardSample, build_reward_set


@pytest.fixture(scope="module", autouse=True)
def _verifiers_extra():
    """The verifiers extra, imported when this file's tests run, not when pytest collects them: each xdist worker
    collects every file, and importing verifiers with its dependencies (openai, anthropic, math-verify, ...)
    takes ~4.6 s."""
    use_extra("verifiers")

# A taskset in verifiers' own classes: "What is a + b?" with an adder tool; reward 1 when the last reply holds the
# sum; the episode stops once a reply says "FINAL".
ARITH = '''
import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: int


class Adder(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class AddTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Adder(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if str(self.data.answer) in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply) <= 20 else 0.0

    @vf.stop
    async def final(self, trace: vf.Trace) -> bool:
        return "FINAL" in trace.last_reply


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 8
    task: AddTaskConfig = AddTaskConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield AddTask(AddData(prompt=f"What is {i} + {2 * i}?", system_prompt="Be brief.", answer=3 * i),
                          self.config.task)


__all__ = ["AddTaskset"]
'''

CONTAINER = '''
import verifiers.v1 as vf


class BoxTask(vf.Task):
    NEEDS_CONTAINER = True


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self):
        yield BoxTask(vf.TaskData(prompt="hi"))


__all__ = ["BoxTaskset"]
'''

RUNTIME = '''
import verifiers.v1 as vf


class RunTask(vf.Task):
    @vf.reward
    async def needs_box(self, trace: vf.Trace, runtime) -> float:
        return 1.0


class RunTaskset(vf.Taskset[RunTask, vf.TasksetConfig]):
    def load(self):
        yield RunTask(vf.TaskData(prompt="hi"))


__all__ = ["RunTaskset"]
'''

MULTI_AGENT = '''
import verifiers.v1 as vf


class DuoConfig(vf.EnvConfig):
    a: vf.AgentConfig = vf.AgentConfig()
    b: vf.AgentConfig = vf.AgentConfig()


class Duo(vf.Env[DuoConfig]):
    async def run(self, task, agents):
        pass


class DuoTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="hi"))


__all__ = ["DuoTaskset", "Duo"]
'''

PACKAGES = {"tt_vf_add": ARITH, "tt_vf_box": CONTAINER, "tt_vf_run": RUNTIME, "tt_vf_duo": MULTI_AGENT}


@pytest.fixture(scope="module")
def tasksets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasksets")
    for name, source in PACKAGES.items():
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def test_dataset_prompts_from_tasks(tasksets, tokenizer):
    ds = verifiers_dataset(tokenizer, "tt_vf_add", {"num_tasks": 5}, num_tasks=3, start=1, prompt_style="r1",
                           max_prompt_length=None)
    assert [ds[i]["question"] for i in range(3)] == ["What is 1 + 2?", "What is 2 + 4?", "What is 3 + 6?"]
    assert [ds[i]["vf_idx"] for i in range(3)] == [1, 2, 3]
    assert ds[0]["prompt"].startswith("Be brief.")  # the tasks' own system prompt


def test_single_turn_reward_is_the_tasks_rubric(tasksets):
    reward = VerifiersReward("tt_vf_add")
    rows = [{"vf_idx": 2}, {"vf_idx": 2}, {"vf_idx": 3}]
    completions = ["6", "The answer is 6, which I computed carefully.", "5"]
    # correct (weight 1) + brief (weight 0.5): 1 + 0.5, 1 + 0, 0 + 0.5
    assert reward(RewardBatch([""] * 3, completions, [[]] * 3, rows)) == [1.5, 1.0, 0.5]


def test_reward_scores_the_whole_conversation(tasksets):
    reward = VerifiersReward("tt_vf_add")
    conversation = [
        {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 4, "b": 8}}</tool_call>'},
        {"role": "tool", "name": "add", "content": "12"},
        {"role": "assistant", "content": "12 FINAL"},
    ]
    assert asyncio.run(reward.score_one(RewardSample("", "ignored", [], {"vf_idx": 4, "conversation": conversation}))) == 1.5
    # a row of another dataset fails that sample only
    rewards = build_reward_set([{"_component_": "torchtune_grpo.envs.VerifiersReward", "taskset": "tt_vf_add"}], fallback=-1.0)
    out = rewards(RewardBatch(["", ""], ["0", "0"], [[], []], [{"vf_idx": 0}, {"answer": "1"}]))
    assert out.total.tolist() == [1.5, -1.0] and out.errors == {"verifiers": 1}


def test_tool_episode_with_stop_condition(tasksets):
    env = VerifiersEnvironment("tt_vf_add")
    assert [t["function"]["name"] for t in env.tools] == ["add"]
    assert env.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    (state,) = [o.value for o in start_episodes(env, [{"vf_idx": 5}], 10)]
    call = {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 10}}\n</tool_call>'}
    reply = step_episodes(env, [state], [call], 10)[0].value
    assert reply.messages == [{"role": "tool", "name": "add", "content": "15"}] and not reply.done
    # no tool call but no stop either: ToolEnvironment's rule ends it (the final answer) ...
    assert step_episodes(env, [state], [{"role": "assistant", "content": "15"}], 10)[0].value.done
    # ... and the task's @vf.stop ends an episode even while it calls tools
    (state,) = [o.value for o in start_episodes(env, [{"vf_idx": 5}], 10)]
    stopped = step_episodes(env, [state], [{"role": "assistant", "content": call["content"] + " FINAL"}], 10)[0].value
    assert stopped.done and stopped.info["stopped"] == 1


@pytest.mark.parametrize("taskset, feature", [
    ("tt_vf_box", "container tasks"),
    ("tt_vf_run", "runtime-dependent signals"),
    ("tt_vf_duo", "multi-agent environments"),
])
def test_unsupported_features_are_refused_by_name(tasksets, tokenizer, taskset, feature):
    with pytest.raises(UnsupportedVerifiersFeature, match=feature):
        verifiers_dataset(tokenizer, taskset, num_tasks=1)


def test_unknown_taskset_is_verifiers_own_error(tasksets):
    with pytest.raises(ModuleNotFoundError, match="tt_vf_nothing"):
        load_taskset("tt_vf_nothing")


def _config(tmp_path: Path, multi_turn: bool, engine: str = "native") -> Path:
    cfg = OmegaConf.load(TINY_CONFIG)
    if engine == "vllm":  # the episodes go through the project's rollout: any engine samples them
        cfg.generation = {"_component_": "torchtune_grpo.generation.VLLMGenerator",
                          "model": "${checkpointer.checkpoint_dir}", "temperature": 1.0, "max_model_len": 256,
                          "kv_cache_memory_gib": 0.25}
    cfg.output_dir = str(tmp_path / "out")
    cfg.max_steps, cfg.save_every_n_steps = 2, 2
    cfg.max_response_length = 32
    cfg.dataset = {"_component_": "torchtune_grpo.envs.verifiers_dataset", "taskset": "tt_vf_add",
                   "taskset_config": {"num_tasks": 16}, "num_tasks": 16, "prompt_style": "r1", "max_prompt_length": 128}
    cfg.reward_functions = [{"_component_": "torchtune_grpo.envs.VerifiersReward", "taskset": "tt_vf_add",
                             "taskset_config": {"num_tasks": 16}, "name": "correctness"}]
    if multi_turn:
        cfg.environment = {"_component_": "torchtune_grpo.envs.VerifiersEnvironment", "taskset": "tt_vf_add",
                           "taskset_config": {"num_tasks": 16}}
        cfg.multi_turn = {"max_turns": 2, "env_timeout": 30}
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path)
    return path


def _assert_trained(steps, multi_turn: bool) -> None:
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert all("reward/correctness/mean" in r and r["reward/correctness/errors"] == 0 for r in steps)
    if multi_turn:
        assert all(r["reward/environment/errors"] == 0 and r["episode/turns"] >= 1 for r in steps)


def test_recipe_trains_on_a_single_turn_verifiers_taskset(tasksets, tmp_path, clean_env, one_thread):
    # A dataset and a reward: a claim about what the run computes, so in this process (the multi-turn config
    # goes through `tune run` on two processes: test_resume_and_two_processes).
    run_in_process(_config(tmp_path, multi_turn=False))
    _assert_trained([r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r], multi_turn=False)


@pytest.mark.parametrize("multi_turn, engine", [(True, "vllm")], ids=["multi_turn_vllm"])
def test_recipe_trains_on_a_verifiers_taskset(tasksets, tmp_path, monkeypatch, multi_turn, engine):
    extra_pythonpath(monkeypatch, "verifiers", str(tasksets))
    run_tune(_config(tmp_path, multi_turn, engine), cwd=tmp_path)
    _assert_trained([r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r], multi_turn)


@pytest.mark.slow
def test_resume_and_two_processes(tasksets, tmp_path: Path, monkeypatch):
    extra_pythonpath(monkeypatch, "verifiers", str(tasksets))
    cfg = OmegaConf.load(_config(tmp_path, multi_turn=True))
    check_resume_equals_uninterrupted(cfg, tmp_path)
    # The multi-turn config through `tune run` with the native engine, on two processes.
    _assert_trained(check_two_processes(cfg, tmp_path), multi_turn=True)
