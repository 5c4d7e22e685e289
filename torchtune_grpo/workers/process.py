"""A generation worker: a process of its own that samples and scores rollouts with its own copy of the policy.

The trainer side is :class:`~torchtune_grpo.workers.client.WorkerRollouts`; this module is what runs in the
worker process (a fresh process, spawned or forked from a fork server that only imported :data:`PRELOAD`:
nothing of the trainer's state is inherited; the trainer's environment variables are set again at the start).
The worker builds the tokenizer, the model, the engine, the rewards and the multi-turn environment from the
run's config, then serves its request queue in order (FIFO, which is what makes the schedule deterministic):

- ``("weights", version, state_dict, probe)``: load weights version ``version`` (training steps taken): the
  first one every weight, later ones every weight that training changes (with a frozen LoRA base: the
  adapters); with a ``probe`` (token ids), reply ``("probe", version, logprobs [L - 1])`` scored with the
  new weights;
- ``("generate", index, batch, version)``: sample and score batch ``index`` with weights ``version`` (which
  must be the loaded one), compute the behaviour log-probabilities of the sampled tokens with the same
  weights, and reply ``("rollouts", index, RolloutGroups, version, generator_state, seconds)``;
- ``("stop",)``: leave.

With ``generation_workers.in_flight_updates`` (a ``VLLMServerGenerator``; docs/async.md, "In-flight weight
updates") a batch generates on a thread of its own while this loop goes on reading: a weights version that
arrives meanwhile goes into the server at once (``load_weights(..., in_flight=True)``: paused, updated, the
running completions continued with the new weights), and the next ``generate`` waits for the batch before it.
Every token then carries the training step of the weights that sampled it (``token_versions``) and each row
reports its oldest (``weight_versions``), which is what the trainer's staleness bound counts.

With images in the prompt (``WorkerSpec.image_source``; docs/multimodal.md) the worker's copy of the policy gets the
directory's image side (:func:`~torchtune_grpo.models.attach_images`, with the run's ``train_vision``: a trained
projector or tower is part of the policy's state dict, so every weights version carries it). Each prompt's image
inputs travel in its batch's fields; the engine samples with them and the behaviour log-probabilities are computed
with them, one row per sequence, as the trainer's.

With an engine that holds its own weights (vLLM, ``VLLMGenerator``), the worker builds no model of its own:
the weights go into the engine through its in-place reload (``load_weights``, the synchronous recipe's
verified sync), the probe is scored by the engine (``prompt_logprobs``), and the behaviour log-probabilities
are the engine's own for its sampled tokens.

On another machine the same worker serves the same messages over TCP (``python -m
torchtune_grpo.workers.process --listen HOST:PORT``; :mod:`torchtune_grpo.workers.channel`).

A worker whose trainer died (SIGKILL: no goodbye) notices within seconds and leaves. Any exception is replied as ``("error", traceback)`` before the worker exits. The sampling generator is one
stream, seeded like the synchronous recipe's (``seed + rank``) and consumed in batch order, so a worker run at
``max_staleness: 0`` samples the same tokens as the synchronous recipe; its state after each batch goes back
with the batch, for checkpoints.
"""

import importlib
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, Dict, List, Optional

import torch

__all__ = [
    "PRELOAD", "TrainerStdio", "WorkerSpec", "adopt_trainer_context", "behaviour_logprobs", "local_worker_main", "main",
    "worker_main",
]

# How often an idle worker checks that its trainer is alive: a killed trainer's worker (a SIGKILL leaves it no
# time to say stop) exits within this, releasing the trainer's stdout and stderr, which it holds. A wake-up a
# second costs nothing measurable.
_PARENT_CHECK_SECONDS = 1.0

# What a worker imports to build its side: a fork server imports these once and forks each worker from it
# (``torchtune_grpo.workers.client``), so that only the first worker of a trainer process pays for them. The
# package first: it quiets torchao's import-time line before torchtune imports torchao (runtime/quiet.py).
PRELOAD = (
    "torchtune_grpo", "omegaconf", "torchtune.config", "torchtune.training", "torchtune_grpo.assets", "torchtune_grpo.config",
    "torchtune_grpo.generation", "torchtune_grpo.rewards", "torchtune_grpo.rollouts.groups",
    "torchtune_grpo.runtime.model_setup", "torchtune_grpo.training.batch", "torchtune_grpo.models.logprobs",
    "torchtune_grpo.workers.process",
)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its side (picklable: it crosses the ``spawn``).

    Attributes:
        config (Dict[str, Any]): the run's resolved config (a plain container).
        rank (int): the trainer rank this worker serves.
        threads (int): intra-op threads of the worker.
        dtype (str): the compute dtype name (``float32``, ``bfloat16``) its model holds.
        generator_state (Optional[torch.Tensor]): the sampling generator's state to start from (a resumed run);
            None seeds it with ``seed + rank``.
        seed (int): the run's seed.
        config_class (str): the recipe's typed config class, by import path (the LoRA recipe's has its keys).
        device (str): where a native-engine worker's model computes (``cpu`` or ``cuda``: its first visible
            GPU); its sampling generator lives there too, as the synchronous recipe's does on its device.
        image_source (Optional[str]): the prompts carry images (docs/multimodal.md): the multimodal directory the
            worker's copy of the policy takes its vision tower and projector from, as the trainer's did (the
            source, or the step a run resumes); None: text prompts.
    """

    config: Dict[str, Any]
    rank: int
    threads: int
    dtype: str
    seed: int
    generator_state: Optional[torch.Tensor] = None
    config_class: str = "torchtune_grpo.config.schema.RecipeConfig"
    device: str = "cpu"
    image_source: Optional[str] = None


def behaviour_logprobs(
    model: torch.nn.Module, prompt_ids: List[List[int]], response_ids: List[List[int]], *, pad_id: int,
    micro_batch_size: int, temperature: float, chunk_size: int, share_prompt: bool,
    device: torch.device = torch.device("cpu"), max_tokens: Optional[int] = None,
    routed_experts: Optional[List[torch.Tensor]] = None, replay: bool = False,
    images: Optional[List[Optional[Dict[str, torch.Tensor]]]] = None,
) -> List[List[float]]:
    """The log-probability of every response token under ``model`` (the weights that sampled it), per row.

    Computed with the trainer's own layout, forward and micro-batches (:class:`~torchtune_grpo.training.batch.TrainingBatch`,
    :func:`~torchtune_grpo.training.batch.batch_logprobs`; with ``max_tokens``, the token-budget plan of the whole
    batch), so with the same weights the values equal the trainer's (one process, one mini-batch: to the
    last bit). With ``replay`` (``moe.routing_replay: rollout``) the engine's ``routed_experts`` are forced, as the
    trainer forces them. With ``images`` (each row's prompt image inputs) every forward sees its rows' images, one
    row per sequence, as the trainer's forwards do.

    Returns:
        List[List[float]]: one list per row, ``len(response_ids[i])`` values.
    """
    from torchtune_grpo.training.batch import TrainingBatch
    from torchtune_grpo.training.batch import batch_logprobs

    layout = TrainingBatch(prompt_ids, response_ids, pad_id, share_prompt=share_prompt, device=device,
                           routed_experts=routed_experts, replay=replay, images=images)
    plan = None if max_tokens is None else layout.plan(max_tokens=max_tokens, max_rows=micro_batch_size)
    lp = batch_logprobs(model, layout, micro_batch_size=micro_batch_size, temperature=temperature, chunk_size=chunk_size,
                        plan=plan)
    mask = layout.response_mask.bool()
    return [lp[i][mask[i]].tolist() for i in range(len(response_ids))]


class _Worker:
    """The worker's side, built in the worker process from a :class:`WorkerSpec`."""

    def __init__(self, spec: WorkerSpec) -> None:
        from omegaconf import OmegaConf
        from torchtune import config as tt_config, training

        from torchtune_grpo.assets import register_resolvers
        from torchtune_grpo.config import build_multi_turn
        from torchtune_grpo.generation import request_routes
        from torchtune_grpo.runtime.model_setup import init_rope
        from torchtune_grpo.rewards import build_reward_set

        register_resolvers()
        torch.set_num_threads(spec.threads)
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("generation_workers.device is 'cuda' but this worker's process sees no CUDA device")
        cfg = OmegaConf.create(spec.config)
        if cfg.model.get("quantize_base", False):
            # QLoRA: the trainer's state dict holds its NF4 base weights dequantized; quantizing them again
            # here would not give the same values back (3e-4 apart in logprobs on the tiny model), so the
            # worker keeps them as they come, and samples from exactly the trainer's function.
            cfg.model.quantize_base = False
        module, name = spec.config_class.rsplit(".", 1)
        self.config = c = getattr(importlib.import_module(module), name).from_cfg(cfg)
        self.tokenizer = tt_config.instantiate(cfg.tokenizer)
        self.multi_turn = build_multi_turn(c)
        if self.multi_turn is not None:
            self.multi_turn.attach(self.tokenizer)
        self.engine = request_routes(tt_config.instantiate(cfg.generation), c.moe.routing_replay)
        self.model: Optional[torch.nn.Module] = None
        if self.engine.holds_weights and spec.image_source is not None:  # the trainer refuses it first
            raise ValueError(f"{type(self.engine).__name__} holds its own weights and samples no images: a worker for "
                             "image prompts needs an engine that takes them (docs/multimodal.md)")
        if self.engine.holds_weights:  # vLLM: the engine holds the only copy; it computes as the trainer does
            follow = getattr(self.engine, "follow_trainer_dtype", None)
            if follow is not None:
                follow(getattr(torch, spec.dtype))
        else:
            with training.set_default_dtype(getattr(torch, spec.dtype)):
                self.model = tt_config.instantiate(cfg.model).to(self.device)
            init_rope(self.model, self.device)
            if spec.image_source is not None:
                self._attach_images(spec.image_source, c.train_vision)
            self.model.eval().requires_grad_(False)
        self.rewards = build_reward_set(cfg.reward_functions, fallback=c.reward_fallback)
        self.generator = torch.Generator(device=self.device if self.model is not None else "cpu")
        if spec.generator_state is not None:
            self.generator.set_state(spec.generator_state)
        else:
            self.generator.manual_seed(spec.seed + spec.rank)
        self.version: Optional[int] = None
        self.in_flight_updates = bool(c.generation_workers.in_flight_updates)
        self.steps_of_engine_versions: Dict[int, int] = {}  # the engine's weight versions -> training steps

    def _attach_images(self, source: str, train: str) -> None:
        """The policy copy's image side, as the trainer's (:func:`~torchtune_grpo.models.attach_images`).

        With ``train_vision`` the trained modules are the policy's (``trained_vision.*`` in its state dict): the
        same modules here, so every weights version brings their trained values with the language weights.
        """
        from torchtune_grpo.models import attach_images

        attach_images(self.model, source, train=train)

    def load(self, version: int, state: Dict[str, torch.Tensor], *, in_flight: bool = False) -> None:
        if self.model is None:
            if self.in_flight_updates:
                # Known before the engine can label a token with it (a generating thread reads it).
                self.steps_of_engine_versions[self.engine.weight_version + 1] = version
                self.engine.load_weights(state.items(), in_flight=in_flight)
            else:
                self.engine.load_weights(state.items())
        else:
            # The first version holds every weight; with a frozen base (LoRA) later ones only the trained.
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or (missing and self.version is None):
                raise RuntimeError(f"weights version {version}: unexpected {sorted(unexpected)[:5]}, missing "
                                   f"{sorted(missing)[:5]} (a worker's first version must hold every weight)")
        self.version = version

    def probe(self, tokens: List[int]) -> torch.Tensor:
        from torchtune_grpo.models.logprobs import sequence_logprobs

        if self.model is None:
            return self.engine.prompt_logprobs(tokens)
        with torch.no_grad():
            return sequence_logprobs(
                self.model, torch.tensor([tokens], device=self.device), chunk_size=self.config.logprob_chunk_size
            ).logprobs[0].cpu()

    def check_version(self, version: int) -> None:
        if version != self.version:  # the trainer's FIFO schedule guarantees it; anything else is a bug
            raise RuntimeError(f"asked for weights version {version}, holding {self.version}")

    def generate(self, batch: Any, version: int) -> Any:
        """Sample and score ``batch`` (weights ``version``, checked by the caller with :meth:`check_version`)."""
        from torchtune_grpo.rollouts.groups import sample_and_score
        from torchtune_grpo.training.experience import row_images

        c = self.config
        groups = sample_and_score(
            self.model, self.tokenizer, self.engine, batch, self.rewards, group_size=c.group_size,
            max_new_tokens=c.max_response_length, generator=self.generator, multi_turn=self.multi_turn,
        )
        if self.model is not None:  # an engine with its own weights returned its logprobs already
            groups.engine_logprobs = behaviour_logprobs(
                self.model, groups.prompt_ids, groups.response_ids, pad_id=self.tokenizer.pad_id,
                micro_batch_size=c.micro_batch_size, temperature=float(self.engine.temperature),
                chunk_size=c.logprob_chunk_size, share_prompt=c.share_prompt_in_training, device=self.device,
                max_tokens=c.max_tokens_per_micro_batch, routed_experts=groups.routed_experts,
                replay=c.moe.routing_replay == "rollout" and groups.routed_experts is not None,
                images=row_images(groups),
            )
        if self.in_flight_updates:
            steps = [[self.steps_of_engine_versions[v] for v in row] for row in groups.token_versions]
            if any(v < version for row in steps for v in row):
                raise RuntimeError(f"a token of a batch asked for with weights {version} came from older weights")
            groups.token_versions = steps
            groups.weight_versions = [min(row, default=version) for row in steps]  # the bound counts the oldest
        else:
            groups.token_versions = None
            groups.weight_versions = [version] * len(groups.response_ids)
        return groups


class _BackgroundBatches:
    """In-flight updates: one batch at a time generating on a thread, so weights can reach the engine meanwhile.

    Args:
        worker (_Worker): the worker.
        reply (Callable): puts a reply on the trainer's queue (a lock makes it safe from both threads).
    """

    def __init__(self, worker: "_Worker", reply: Any) -> None:
        self.worker, self.reply = worker, reply
        self.thread: Optional[threading.Thread] = None

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def start(self, index: int, batch: Any, version: int) -> None:
        self.wait()  # batches go out in order, one at a time
        self.worker.check_version(version)

        def run() -> None:
            try:
                t0 = time.perf_counter()
                groups = self.worker.generate(batch, version)
                self.reply(("rollouts", index, groups, version, self.worker.generator.get_state(),
                            time.perf_counter() - t0))
            except BaseException:  # noqa: B902 - the trainer stops the run naming the worker
                self.reply(("error", traceback.format_exc()))

        self.thread = threading.Thread(target=run, name=f"generate-batch-{index}", daemon=True)
        self.thread.start()


def worker_main(spec: WorkerSpec, requests: Any, replies: Any) -> None:
    """The worker process: build, then serve ``requests`` in order until ``("stop",)`` (see the module docstring)."""
    worker = None
    lock = threading.Lock()

    def reply(message: Any) -> None:
        with lock:
            replies.put(message)

    background = None
    try:
        worker = _Worker(spec)
        background = _BackgroundBatches(worker, reply) if worker.in_flight_updates else None
        reply(("ready", os.getpid()))
        parent = mp.parent_process()
        while True:
            try:
                message = requests.get(timeout=_PARENT_CHECK_SECONDS)
            except queue.Empty:
                if parent is not None and not parent.is_alive():  # the trainer was killed: nothing to serve
                    return
                continue
            except EOFError:  # a remote trainer's connection closed (workers/channel.py): nothing to serve
                return
            kind = message[0]
            if kind == "stop":
                break
            if kind == "weights":
                _, version, state, probe = message
                worker.load(version, state, in_flight=background is not None and background.busy)
                del state
                if probe is not None:
                    reply(("probe", version, worker.probe(probe)))
            elif kind == "generate":
                _, index, batch, version = message
                if background is not None:
                    background.start(index, batch, version)
                    continue
                worker.check_version(version)
                t0 = time.perf_counter()
                groups = worker.generate(batch, version)
                reply(("rollouts", index, groups, version, worker.generator.get_state(), time.perf_counter() - t0))
            else:
                raise ValueError(f"unknown request {kind!r}")
    except BaseException:  # noqa: B902 - everything goes back to the trainer, which stops the run naming us
        reply(("error", traceback.format_exc()))
    finally:
        if background is not None:
            background.wait()
        if worker is not None:
            worker.engine.close()  # vLLM's engine core shuts down with its process


class TrainerStdio:
    """The trainer's stdout and stderr (file descriptors 1 and 2) as they are when a worker starts, sent along
    with it: a worker forked from a fork server would otherwise write to the ones of the moment that server
    started (they differ where something redirects them in between, as pytest does for each test)."""

    def __reduce__(self):
        # Pickled only while a process starts: multiprocessing then passes the descriptors to the child.
        return _stdio_in_child, (reduction.DupFd(1), reduction.DupFd(2))


def _stdio_in_child(stdout: Any, stderr: Any) -> List[int]:
    return [stdout.detach(), stderr.detach()]


def adopt_trainer_context(environ: Dict[str, str], stdio: Optional[List[int]] = None) -> None:
    """Take the trainer's environment variables (``environ``) and, when given, its stdout and stderr (``stdio``:
    a :class:`TrainerStdio` as received) as they were when this worker started. A worker forked from a fork
    server would otherwise have those of the moment that server started."""
    os.environ.clear()
    os.environ.update(environ)
    for received, target in zip(stdio or [], (1, 2)):
        if received != target:  # a spawned worker already has the trainer's
            os.dup2(received, target)
            os.close(received)


def local_worker_main(environ: Dict[str, str], spec: WorkerSpec, requests: Any, replies: Any,
                      stdio: Optional[List[int]] = None) -> None:
    """A worker started by a trainer on its own node: :func:`adopt_trainer_context`, then :func:`worker_main`."""
    adopt_trainer_context(environ, stdio)
    worker_main(spec, requests, replies)


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m torchtune_grpo.workers.process --listen HOST:PORT``: a worker for trainers on other nodes."""
    import argparse

    from torchtune_grpo.workers.channel import authkey, parse_address, serve

    parser = argparse.ArgumentParser(
        description="A generation worker that trainers reach over TCP (generation_workers.addresses; docs/async.md). "
        "The trainer sends the run's config; the same secret must be in TORCHTUNE_GRPO_WORKER_KEY on both sides."
    )
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="e.g. 0.0.0.0:29600 (every interface)")
    parser.add_argument("--connections", type=int, default=None, help="leave after this many trainers (default: serve until killed)")
    args = parser.parse_args(argv)
    serve(parse_address(args.listen, "--listen"), authkey("--listen"), worker_main, connections=args.connections)


if __name__ == "__main__":
    main()
