"""Helpers shared by the recipe tests: write a tiny config, run the recipe, read results.

A recipe runs in a test one of two ways:

- :func:`run_tune`: ``tune run`` in a subprocess, on 1 or N processes, exactly as a user runs it (launcher,
  module lookup, exit codes);
- :func:`recipe_in_process` (a context manager yielding the set-up recipe, for tests that drive or inspect
  it through its public parts: ``train_step()``, ``step``, ``model``, ...) or :func:`run_in_process` (the
  whole run, ``setup`` + ``train`` + ``cleanup``): in this process, without the launcher's start-up (10-20 s
  of imports per ``tune run`` on 2 cores), the environment, thread count and process group restored after.

Tests of the constructor's or ``setup``'s own errors build the class directly.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from torchtune import config as tt_config, training

from tests.conftest import REPO, TINY_CONFIG

TUNE = str(Path(sys.executable).parent / "tune")
# PYTHONPATH as pytest started (test files import this module at collection, before any test changes it).
_PYTHONPATH_AT_START = os.environ.get("PYTHONPATH", "")
REQUIRED_METRICS = {
    "step", "loss", "policy_loss", "kl", "entropy", "reward/mean", "reward/std", "clip_fraction",
    "response_length/mean", "response_length/terminated_mean", "truncated_fraction", "zero_std_fraction",
    "dynamic_sampling/rounds", "dynamic_sampling/groups_dropped", "grad_norm", "lr", "tokens_per_second",
    "time/generation", "time/train", "time/step", "time/reference", "time/old_logprobs", "time/experience",
    "time/update", "time/compile",
}

# Every key torchtune's full_finetune_single_device recipe reads (the demos' SFT configs must have them).
SFT_RECIPE_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "dataset", "seed", "shuffle", "batch_size", "epochs",
    "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer", "optimizer_in_bwd", "loss", "device", "dtype",
    "compile", "enable_activation_checkpointing", "enable_activation_offloading", "metric_logger",
    "resume_from_checkpoint",
}


def write_config(
    tmp_path: Path, base: Union[Path, str] = TINY_CONFIG, vowel_reward: bool = True, **overrides
) -> Path:
    """Copy a config with ``output_dir`` in ``tmp_path`` and ``overrides`` (dotted keys) applied.

    ``vowel_reward`` adds :class:`tests._rewards.VowelFractionReward`, so the random tiny model gets a
    learning signal (its format/correctness rewards are all 0).
    """
    cfg = OmegaConf.load(base)
    cfg.output_dir = str(tmp_path / "out")
    if vowel_reward:
        cfg.reward_functions.append({"_component_": "tests._rewards.VowelFractionReward", "weight": 1.0})
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path)
    return path


def tune_command(
    config_path: Path,
    *overrides: str,
    nproc: int = 1,
    recipe: str = "grpo_full_finetune_distributed",
    launcher_args: Sequence[str] = (),
) -> List[str]:
    """``tune run [LAUNCHER_ARGS] [--nproc_per_node N] RECIPE --config ... OVERRIDES``."""
    cmd = [TUNE, "run", *launcher_args]
    if nproc > 1:
        cmd += ["--nproc_per_node", str(nproc)]
    return cmd + [recipe, "--config", str(config_path), *overrides]


def tune_env(**extra: str) -> Dict[str, str]:
    """The environment of a ``tune run``: the repository and its ``recipes/`` first on PYTHONPATH (test-only
    components such as ``tests._rewards`` import, and this checkout's recipe modules run, not those of
    whichever checkout is installed), one intra-op thread, and ``extra``. Entries already on PYTHONPATH are
    kept after them: where packages are not installed in the interpreter but put on the path (the GPU
    check's wheels, scripts/gpu_check.sh), the launched recipe needs them too. ``PYTHONFAULTHANDLER``: a rank
    that dies on a signal (gloo aborts with SIGABRT) prints every thread's Python stack, so a failure says
    where the run was (a collective, the checkpoint's gather, the teardown after all work; DESIGN.md)."""
    inherited = filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))
    path = os.pathsep.join([str(REPO), str(REPO / "recipes"), *inherited])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **extra}


def launch_command(command: List[str], *, forked: bool = True, vllm: bool = False,
                   **extra: str) -> Tuple[List[str], Dict[str, str]]:
    """``command`` (``[TUNE, "run", ...]`` or ``[torchrun, ...]``: a Python console script and its arguments) and
    the environment to run it in (:func:`tune_env` with ``extra``), for ``subprocess``. ``forked``: the command and
    the ranks torchrun starts are forked from a process that imported torch, torchtune and the recipes once
    (:func:`forked_python`; ``vllm``: and vLLM); False: fresh interpreters, as a user's. Exit codes and signals are
    the real ones either way (a SIGKILLed run's return code is -9). Default is True."""
    env = tune_env(**extra)
    if forked:
        command = forked_python(command, env, vllm=vllm)
    return command, env


def _tune_launch(config_path: Path, overrides: tuple, nproc: int, recipe: str, env: Optional[Dict[str, str]],
                 forked: bool = True) -> Tuple[List[str], Dict[str, str]]:
    """:func:`run_tune`'s command and environment (forked with vLLM imported where the config's engine is vLLM's)."""
    engine = str(OmegaConf.select(OmegaConf.load(config_path), "generation._component_", default=""))
    return launch_command(tune_command(config_path, *overrides, nproc=nproc, recipe=recipe), forked=forked,
                          vllm="VLLM" in engine, **(env or {}))


def run_tune(
    config_path: Path,
    *overrides: str,
    nproc: int = 1,
    cwd: Path,
    recipe: str = "grpo_full_finetune_distributed",
    env: Optional[Dict[str, str]] = None,
    forked: bool = True,
) -> str:
    """``tune run [--nproc_per_node N] RECIPE --config ...``; returns the output.

    Runs from ``cwd`` (outside the repository: the recipe is an installed module) with the repository on
    PYTHONPATH, so test-only components (``tests._rewards``...) import; ``env`` adds variables
    (:func:`tune_env`). ``forked``: the ``tune`` command and its ranks are forked from a process that imported
    torch, torchtune and the recipes once (tests/_tune_server.py; with vLLM too where the config's engine is
    vLLM's), instead of each starting an interpreter (~6 s of imports each, ~10 s more for vLLM); False: fresh
    interpreters, as a user's ``tune run``. Default is True.
    """
    cmd, run_env = _tune_launch(config_path, overrides, nproc, recipe, env, forked)
    proc = subprocess.run(cmd, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"tune run failed ({proc.returncode}):\n{output[-6000:]}"
    return output


class BackgroundTune:
    """:func:`run_tune`'s run, started now and awaited later (:meth:`output`): a test file's runs that share nothing
    go on at once (each of their processes holds one thread; a run on one process, or one waiting on a server,
    leaves a core idle). Same command, environment and checks as :func:`run_tune`; stdout and stderr go, together,
    to ``cwd / "tune.log"``.

    Args:
        config_path (Path): the run's config.
        *overrides (str): ``key=value`` overrides.
        nproc (int): processes. Default is 1.
        cwd (Path): where it runs.
        recipe (str): the recipe. Default is ``grpo_full_finetune_distributed``.
        env (Optional[Dict[str, str]]): variables added (:func:`tune_env`). Default is None.
    """

    def __init__(self, config_path: Path, *overrides: str, nproc: int = 1, cwd: Path,
                 recipe: str = "grpo_full_finetune_distributed", env: Optional[Dict[str, str]] = None):
        command, run_env = _tune_launch(config_path, overrides, nproc, recipe, env)
        self.log = cwd / "tune.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, cwd=cwd, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                         text=True)

    def output(self) -> str:
        """The run's output, once it has exited with 0 (as :func:`run_tune`: within 600 s)."""
        try:
            self.proc.wait(timeout=600)
        finally:
            self.stop()
        output = self.log.read_text()
        assert self.proc.returncode == 0, f"tune run failed ({self.proc.returncode}):\n{output[-6000:]}"
        return output

    def stop(self) -> None:
        """Kill the run if it is still going (a test that failed before awaiting it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def forked_python(command: List[str], env: Dict[str, str], vllm: bool = False) -> List[str]:
    """``python COMMAND...`` (``[SCRIPT, ARG...]``; the ``tune`` script is one) as a child forked from this
    process's fork server (tests/_tune_server.py), which imported torch, torchtune and the recipes (``vllm``: and
    vLLM) once; ``env`` (the command's) gets torchrun's ``PYTHON_EXEC``, so that its ranks are forked too.

    vLLM's server starts with the PYTHONPATH pytest started with (never with a folder a test added, an extra's),
    and serves a command whose PYTHONPATH adds no folder holding a module it imported (tests/_tune_server.py)."""
    from tests._tune_server import forked

    return forked(command, env, server_env=_fork_server_env(vllm), vllm=vllm)


def forked_vllm_python() -> str:
    """An executable that stands in for ``python`` (``[-u] SCRIPT|-m MODULE ARG...``), running its arguments in a
    child forked from the fork server that imported vLLM (tests/_tune_server.py): the value of
    ``TORCHTUNE_GRPO_VLLM_PYTHON`` for the tests' ``vllm serve`` processes (its ~11-14 s of imports paid once per
    pytest process). The server's PYTHONPATH is the one pytest started with (:func:`forked_python`); a server
    whose PYTHONPATH adds a folder holding a module it imported runs in a fresh interpreter (scripts/fork_stages.py).
    """
    from tests._tune_server import python

    return python(_fork_server_env(vllm=True), vllm=True)


def _fork_server_env(vllm: bool) -> Dict[str, str]:
    """The fork server's environment (``vllm``: with the PYTHONPATH pytest started with)."""
    server_env = tune_env()
    if vllm:
        at_start = [p for p in _PYTHONPATH_AT_START.split(os.pathsep) if p]
        server_env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "recipes"), *at_start])
    return server_env


def _recipe_class(lora: bool) -> type:
    if lora:
        from grpo_lora_finetune_distributed import GRPOLoRAFinetuneRecipeDistributed as Recipe
    else:
        from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed as Recipe
    return Recipe


@contextmanager
def recipe_in_process(
    config: Union[Path, DictConfig], *, lora: bool = False, log: Optional[List[str]] = None
) -> Iterator[Any]:
    """The recipe of ``config``, set up in this process; cleaned up on leaving the block.

    One intra-op thread (as ``tune run`` gets, OMP_NUM_THREADS=1); afterwards the environment (the recipe sets
    RANK, WORLD_SIZE and MASTER_* for its one-process group) and the thread count are restored and the
    process group is gone, so several runs in one test each start as a fresh ``tune run`` would.

    Args:
        config (Union[Path, DictConfig]): the config file, or a loaded config.
        lora (bool): the LoRA recipe instead of the full one. Default is False.
        log (Optional[List[str]]): when given, the run's INFO log messages are appended (what ``tune run``
            would print; module-scoped fixtures cannot use ``caplog``).

    Yields:
        the recipe, after ``setup``.
    """
    import logging

    import torch.distributed as dist

    saved_env, threads = dict(os.environ), torch.get_num_threads()
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: log.append(record.getMessage())
    if log is not None:
        logging.getLogger().addHandler(handler)
    torch.set_num_threads(1)
    try:
        cfg = config if isinstance(config, DictConfig) else OmegaConf.load(config)
        recipe = _recipe_class(lora)(cfg)
        recipe.setup(cfg)
        try:
            yield recipe
        finally:
            recipe.cleanup()
    finally:
        torch.set_num_threads(threads)
        logging.getLogger().removeHandler(handler)
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)


def run_in_process(config: Union[Path, DictConfig], *, lora: bool = False, log: Optional[List[str]] = None):
    """The whole run (``setup``, ``train``, ``cleanup``) in this process (:func:`recipe_in_process`);
    returns the recipe (after cleanup) for tests that inspect it."""
    with recipe_in_process(config, lora=lora, log=log) as recipe:
        recipe.train()
    return recipe


def run_script_expecting(source: str, marker: str, tmp_path: Path) -> None:
    """Run ``source`` as a Python script (repository on PYTHONPATH) and assert it printed ``marker``.

    Judged by the script's own success marker, not its exit code: a gloo process group may abort at exit
    after all work is done (DESIGN.md).
    """
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert marker in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def run_results_script(source: str, args: Sequence[str], tmp_path: Path) -> Dict[str, Any]:
    """Run ``source`` as a script in ``tmp_path`` (repository on PYTHONPATH, one thread) with ``args``; the
    JSON it printed on its ``RESULTS `` line. For scenarios that must not share the pytest process (a vLLM
    engine changes process-wide state when it starts), measured once and asserted on by several tests.

    The script's process is forked from the server that has imported torch and vLLM (tests/_tune_server.py), a
    process of its own that has done nothing else, instead of importing them itself (~15 s on 2 cores)."""
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = forked_python([str(script), *args], env, vllm=True)
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} failed ({proc.returncode}):\n{output[-6000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


_GLOO_PREAMBLE = """import os, sys
import torch, torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # as the recipe's: no port
"""


def run_in_one_process_group(body: str, marker: str, tmp_path: Path) -> None:
    """Run ``body`` in a fresh process inside a one-process gloo group (``os``, ``sys``, ``torch`` and
    ``dist`` imported); it passes by reaching its end, which prints ``marker``."""
    tail = f"print({marker!r})\nsys.stdout.flush()\ndist.destroy_process_group()\nos._exit(0)\n"
    run_script_expecting(_GLOO_PREAMBLE + body.strip("\n") + "\n" + tail, marker, tmp_path)


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny_model_from(checkpoint_dir: Path, tmp_path: Path):
    """Build the tiny torchtune model and load a checkpoint directory through torchtune's HF checkpointer."""
    cfg = OmegaConf.load(TINY_CONFIG)
    model = tt_config.instantiate(cfg.model)
    files = sorted(p.name for p in checkpoint_dir.glob("*.safetensors"))
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=str(checkpoint_dir), checkpoint_files=files, model_type="QWEN2",
        output_dir=str(tmp_path / "scratch"),
    )
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model.eval()


def weights(directory: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def with_overrides(config_path: Path, **overrides) -> Path:
    """Apply ``overrides`` (dotted keys) to the config file in place, as `tune run ... key=value` would."""
    cfg = OmegaConf.load(config_path)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    OmegaConf.save(cfg, config_path)
    return config_path


def init_one_process_group() -> None:
    """A one-process gloo group in this process, the one the recipe makes on one process (pair with the
    ``clean_env`` fixture, which destroys it and restores RANK/WORLD_SIZE)."""
    from torchtune_grpo.runtime.collectives import init_process_group

    init_process_group("cpu")
