"""Rollouts from a generation worker, overlapped with training, at a bounded staleness (docs/async.md).

:class:`WorkerRollouts` is the trainer rank's side of one generation worker process
(:mod:`torchtune_grpo.workers.process`). It takes the place of both the synchronous
:class:`~torchtune_grpo.rollouts.producer.RolloutProducer` (``collect``) and the
:class:`~torchtune_grpo.generation.WeightPublisher` (``publish``) in the step
(:class:`~torchtune_grpo.training.step.GRPOStep`).

The schedule, with ``k = max_staleness`` and the run starting (or resuming) after ``s`` training steps::

    start:       weights s -> worker; requests for batches s+1 .. s+k+1, all with weights s
    step j:      collect batch j  ->  train  ->  weights j -> worker  ->  request batch j+k+1 with weights j

Batch ``j`` is therefore sampled from the weights after step ``max(s, j-1-k)`` whatever the timing: the
worker serves its queue in order, and each request names the version it must use. So ``k = 0`` is today's
on-policy step through a worker, ``k = 1`` the deterministic one-step-off mode (batch ``j+1`` is sampled while
step ``j`` trains), and no sample is trained more than ``k`` steps after the weights that produced it. The
worker's sampling stream is consumed in batch order, so runs are reproducible: at ``k = 0`` they equal the
synchronous recipe's, at any ``k`` one run equals another with the same seed, and a resumed run the
uninterrupted one (a checkpoint holds the rollouts in flight and the worker's stream state).

With DAPO's dynamic sampling (``dynamic_sampling.enabled``), a step that needs more informative groups takes
the next batches of the stream: those already sampled ahead (the prefetch), and when none is left, a batch
requested at once with the newest weights (sampled on-policy). Since a step may take several batches, the
pipeline is refilled twice: after the step's batches are collected, to ``k`` in flight with the weights the
worker holds (``j - 1`` at step ``j``: sampled while the trainer updates), and after the update to ``k + 1``
with the new weights ``j``. Each step takes at least one batch, so a batch requested with weights ``v`` while
``n`` are in flight is trained by step ``v + n`` at the latest: ``n <= k`` with ``v = j - 1`` and ``n <= k + 1``
with ``v = j`` both keep the bound. Prompts are used in the stream's order, and at ``k = 0`` the run is the
synchronous recipe's with dynamic sampling, number for number. (Without dynamic sampling a step takes one
batch, so the first refill never requests anything and the schedule above is unchanged.)

Each batch comes back with the worker's log-probabilities of its sampled tokens (the behaviour policy), as
an engine with its own weights (vLLM) gives them: the loss's ``tis_cap`` or ``rollout_correction`` correct
for the staleness (decoupled PPO, Fu et al. 2025, arXiv:2505.24298: the proximal policy is the trainer's
weights at the start of the step, the behaviour policy the worker's), and ``generation/logprob_mismatch``
measures it.
"""

import os
import queue
import time
from multiprocessing import AuthenticationError
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.multiprocessing as mp
from torch import nn
from torchtune import utils

from torchtune_grpo.rollouts.group_selection import DynamicSampling
from torchtune_grpo.generation import full_weights, WeightSyncCheck
from torchtune_grpo.models.logprobs import sequence_logprobs
from torchtune_grpo.metrics.sums import one_process_sum
from torchtune_grpo.rollouts.producer import PromptStream
from torchtune_grpo.rollouts.groups import RolloutGroups
from torchtune_grpo.workers.process import local_worker_main, PRELOAD, TrainerStdio, WorkerSpec
from torchtune_grpo.runtime.waits import WaitReport
from torchtune_grpo.workers.channel import AUTHKEY_ENV, authkey, connect, ConnectionQueue, parse_address

__all__ = ["start_context", "WorkerError", "WorkerRollouts"]

log = utils.get_logger("INFO")


class WorkerError(RuntimeError):
    """A generation worker died, failed or did not answer in time (the message names it)."""


def start_context(device: str) -> Any:
    """How a local worker process starts: ``forkserver`` for a CPU worker on a machine without a visible CUDA
    device, else ``spawn``.

    Either way the worker is a fresh process that inherits nothing of the trainer's state; its environment
    variables, stdout and stderr are the trainer's at the worker's start
    (:func:`~torchtune_grpo.workers.process.adopt_trainer_context`). The fork server is a clean process started
    with the first worker of this trainer process, which imports torch, torchtune and this package once
    (:data:`~torchtune_grpo.workers.process.PRELOAD`). Every later worker is forked from it, so a restarted
    worker, or the next run's worker in the same process, skips those imports (about 5 s on 2 cores). Where
    CUDA may be used, the worker is spawned instead: a process forked from one that may have touched the CUDA
    driver while importing cannot use CUDA.
    """
    if device == "cpu" and not torch.cuda.is_available():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return mp.get_context("spawn")


class WorkerRollouts:
    """One trainer rank's generation worker: its schedule, weights and rollouts (see the module docstring).

    Args:
        spec (WorkerSpec): what the worker builds (config, rank, threads, dtype, seed).
        prompts (PromptStream): this rank's prompts; batches are drawn when they are requested.
        max_staleness (int): ``k``: training steps a batch's weights may lag the trainer's.
        timeout (float): seconds to wait for a reply before the run stops naming the worker.
        device (torch.device): the training device (weights are gathered there, then sent from the CPU).
        check (WeightSyncCheck): every ``check.every_n_syncs`` versions the worker scores a probe with the
            weights it loaded; a difference from the trainer's beyond ``check.tolerance`` stops the run.
        probe_prompt (List[int]): token ids the probe starts from.
        vocab_size (int): the model's vocabulary (random probe tokens).
        chunk_size (int): positions per log-softmax chunk of the trainer's probe forward. Default is 512.
        restarts (int): times a worker that died or went silent is replaced before the run stops. The new
            worker gets the weights and requests the old one had not answered, from the sampling state after
            its last answer, so the run continues as if nothing happened. Default is 3.
        dynamic (Optional[DynamicSampling]): dynamic sampling (more batches of the stream per step while a
            rank lacks informative groups); None is one batch per step. Default is None.
        batch_size (int): prompts (groups) per rank per step, what dynamic sampling fills. Default is 0.
        all_reduce_sum (Callable[[List[float]], List[float]]): sums floats over ranks (every rank takes the
            same number of batches). Default is one process.
        address (Optional[str]): ``host:port`` of a worker started elsewhere (``python -m
            torchtune_grpo.workers.process --listen``; :mod:`~torchtune_grpo.workers.channel`); None spawns
            the worker process here. A restart then reconnects to the address. Default is None.
        connect_timeout (float): seconds to keep trying to connect to ``address`` (at start and after a
            fault) before the run stops naming it. Default is 60.
    """

    def __init__(
        self, spec: WorkerSpec, prompts: PromptStream, *, max_staleness: int, timeout: float, device: torch.device,
        check: WeightSyncCheck, probe_prompt: List[int], vocab_size: int, chunk_size: int = 512, restarts: int = 3,
        dynamic: Optional[DynamicSampling] = None, batch_size: int = 0,
        all_reduce_sum: Callable[[List[float]], List[float]] = one_process_sum,
        address: Optional[str] = None, connect_timeout: float = 60.0,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"generation_workers.max_staleness must be >= 0, got {max_staleness}")
        if dynamic is not None and dynamic.enabled and batch_size < 1:
            raise ValueError(f"dynamic sampling through a worker needs batch_size >= 1, got {batch_size}")
        self.spec = spec
        self.prompts = prompts
        self.max_staleness = int(max_staleness)
        self.timeout = float(timeout)
        self.device = device
        self.check = check
        self.probe_prompt = list(probe_prompt)
        self.vocab_size = int(vocab_size)
        self.chunk_size = int(chunk_size)
        self.name = f"generation worker of rank {spec.rank}"
        self._address: Optional[Tuple[str, int]] = None
        if address is not None:
            key = f"generation_workers.addresses[{spec.rank}]"
            self._address, self._key = parse_address(address, key), authkey(key)
            self.name += f" at {self._address[0]}:{self._address[1]} ({key})"
        self.connect_timeout = float(connect_timeout)
        self._process: Optional[Any] = None  # a local worker's process
        self._connection: Optional[ConnectionQueue] = None  # a remote worker's connection
        self._ready: Dict[int, RolloutGroups] = {}  # batch index -> rollouts received, not yet collected
        self._requested = 0  # batches requested so far (index of the last one)
        self._collected = 0  # batches handed to the trainer
        self._expected_probes: Dict[int, torch.Tensor] = {}
        self._generator_state: Optional[torch.Tensor] = spec.generator_state
        self._versions_published = 0
        self.busy_seconds = 0.0
        self.restarts = int(restarts)
        self.restarts_done = 0
        self.dynamic = dynamic if dynamic is not None else DynamicSampling()
        self.batch_size = int(batch_size)
        self.all_reduce_sum = all_reduce_sum
        # What a replacement worker needs: requests not answered yet (index -> (prompts, weights version)) and
        # the CPU copies of every weights version they or the worker's next request use.
        self._pending: Dict[int, Tuple[Any, int]] = {}
        self._kept: Dict[int, Dict[str, torch.Tensor]] = {}
        self._latest: Optional[int] = None
        # Weights that training never changes (a LoRA/QLoRA base): sent once to each worker, then only the
        # trainable ones (the adapters) each version. None: every weight is trained (full fine-tuning).
        self._trainable: Optional[Set[str]] = None
        self._frozen: Optional[Dict[str, torch.Tensor]] = None
        self._frozen_sent = False

    @classmethod
    def from_config(
        cls, config: Any, config_record: Dict[str, Any], prompts: PromptStream, *, rank: int, world_size: int, seed: int,
        device: torch.device, dtype: torch.dtype, probe_prompt: List[int], vocab_size: int,
        dynamic: Optional[DynamicSampling] = None, all_reduce_sum: Callable[[List[float]], List[float]] = one_process_sum,
        image_source: Optional[str] = None,
    ) -> "WorkerRollouts":
        """The worker of one trainer rank as a recipe config (``generation_workers``, ``weight_sync``) asks.

        Args:
            config (Any): the typed recipe config (its class is rebuilt in the worker).
            config_record (Dict[str, Any]): the resolved config as a plain container (what the worker builds from).
            prompts (PromptStream): this rank's prompts.
            rank (int), world_size (int), seed (int): the rank, the number of trainer processes and the run's seed.
            device (torch.device): the training device.
            dtype (torch.dtype): the compute dtype the worker's model holds.
            probe_prompt (List[int]), vocab_size (int): for the weight check's probe.
            dynamic (Optional[DynamicSampling]), all_reduce_sum: dynamic sampling and the sum over ranks.
            image_source (Optional[str]): the prompts carry images: the directory the worker's policy copy takes its
                vision tower and projector from (the trainer's policy's source); None for text prompts.
                Default is None.
        """
        from torchtune import config as tt_config

        workers = config.generation_workers
        addresses = None if workers.addresses is None else [str(a) for a in workers.addresses]
        if addresses is not None and len(addresses) != world_size:
            raise ValueError(
                f"generation_workers.addresses has {len(addresses)} entries for {world_size} trainer process(es): "
                "give one worker address per rank"
            )
        spec = WorkerSpec(
            config=config_record, rank=rank, threads=workers.threads, seed=seed, device=workers.device,
            dtype=str(dtype).removeprefix("torch."), config_class=f"{type(config).__module__}.{type(config).__qualname__}",
            image_source=image_source,
        )
        check = tt_config.instantiate(config.weight_sync) if config.weight_sync is not None else WeightSyncCheck()
        return cls(
            spec, prompts, max_staleness=workers.max_staleness, timeout=workers.timeout, device=device, check=check,
            probe_prompt=probe_prompt, vocab_size=vocab_size, chunk_size=config.logprob_chunk_size,
            restarts=workers.restarts, dynamic=dynamic, batch_size=config.batch_size, all_reduce_sum=all_reduce_sum,
            address=None if addresses is None else addresses[rank],
            connect_timeout=workers.connect_timeout,
        )

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, model: nn.Module, step: int, in_flight: Optional[Dict[str, Any]] = None) -> None:
        """Start the worker with the weights after ``step`` training steps and fill the pipeline.

        Args:
            model (nn.Module): the policy (every rank calls this: gathering FSDP2 weights is a collective).
            step (int): training steps taken (a resumed run's).
            in_flight (Optional[Dict[str, Any]]): a checkpoint's :meth:`state_dict` (its rollouts are not
                sampled again).
        """
        # Batch indices count the batches collected; with dynamic sampling a step may take several.
        self._collected = self._requested = step
        if in_flight is not None:
            self._generator_state = in_flight["generator_state"]
            self._ready = dict(in_flight["ready"])
            self._collected = in_flight.get("collected", step)
            self._requested = max(self._ready, default=self._collected)
        self._spawn()
        self._send_weights(model, step)
        self._top_up(version=step)

    @property
    def pid(self) -> Optional[int]:
        """The local worker process's id (None for a remote worker, before :meth:`start` and after :meth:`close`)."""
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """Stop the worker (waits briefly, then terminates it; a remote one goes back to waiting for a trainer)."""
        if self._connection is not None:
            self._requests.put(("stop",))
        elif self._process is not None and self._process.is_alive():
            self._requests.put(("stop",))
            self._process.join(timeout=30)
        self._kill()

    def _kill(self) -> None:
        if self._connection is not None:
            self._connection.close(flush=5.0)
            self._connection = None
        if self._process is not None and self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)
        self._process = None

    def _spawn(self) -> None:
        """A worker from the sampling state after the last answered batch (a process here, or a connection to
        ``address``); waits until it is built."""
        spec = WorkerSpec(**{**vars(self.spec), "generator_state": self._generator_state})
        self._frozen_sent = False  # a new worker has no weights yet
        if self._address is not None:
            self._connection = self._connect()
            self._requests = self._replies = self._connection
            self._connection.put(("spec", spec))
        else:
            ctx = start_context(spec.device)
            self._requests, self._replies = ctx.Queue(), ctx.Queue()
            self._process = ctx.Process(
                target=local_worker_main, daemon=True, name=f"grpo-generation-worker-{spec.rank}",
                args=(dict(os.environ), spec, self._requests, self._replies, TrainerStdio()),
            )
            self._process.start()
        message = self._get(replace=False)
        if message[0] != "ready":
            raise WorkerError(f"{self.name}: expected 'ready', got {message[0]!r}")

    def _wait_report(self) -> WaitReport:
        return WaitReport(f"a reply from the {self.name}", limit=self.timeout, limit_key="generation_workers.timeout")

    def _connect(self) -> ConnectionQueue:
        """A connection to the remote worker, retried for ``connect_timeout`` seconds."""
        report = WaitReport(f"the {self.name} to accept a connection", limit=self.connect_timeout,
                            limit_key="generation_workers.connect_timeout")
        while True:
            try:
                return connect(self._address, self._key)
            except AuthenticationError as error:
                raise WorkerError(f"{self.name}: the worker refused the connection ({error}): set the same "
                                  f"{AUTHKEY_ENV} on both sides") from error
            except OSError as error:
                if report.waited >= self.connect_timeout:
                    raise WorkerError(
                        f"{self.name}: nothing accepted a connection for {self.connect_timeout:g} s "
                        f"(generation_workers.connect_timeout; last error: {error}). Start the worker there with "
                        "`python -m torchtune_grpo.workers.process --listen HOST:PORT` (docs/async.md)"
                    ) from error
                report()
                time.sleep(0.5)

    def _replace(self, reason: str) -> None:
        """A new worker in place of a dead or silent one, given everything the old one had not answered."""
        while True:
            if self.restarts_done >= self.restarts:
                raise WorkerError(f"{reason}; generation_workers.restarts = {self.restarts} used up")
            self.restarts_done += 1
            log.warning(f"{reason}: starting a new one ({self.restarts_done} of {self.restarts} restarts)")
            self._kill()
            self._expected_probes.clear()  # the weights go again without probes
            try:
                self._spawn()
                break
            except WorkerError as error:  # died again while starting
                reason = str(error)
        sent = None
        for index in sorted(self._pending):
            batch, version = self._pending[index]
            if version != sent:
                self._requests.put(("weights", version, self._payload(version), None))
                sent = version
            self._requests.put(("generate", index, batch, version))
        if self._latest is not None and self._latest != sent:
            self._requests.put(("weights", self._latest, self._payload(self._latest), None))

    # ---------------------------------------------------------------------------------------- the step

    def collect(self, policy: nn.Module, batch: Any = None) -> "tuple[RolloutGroups, int]":
        """The step's rollouts (waits for the worker when they are not there yet): ``(groups, rounds)``.

        One batch, or with dynamic sampling the next batches of the stream until every rank has enough
        informative groups or ``max_rounds`` batches were taken (see the module docstring).
        ``batch`` must be None: the worker's prompts were drawn when they were requested.
        """
        if batch is not None:
            raise ValueError("a generation worker samples the prompts it was sent; collect takes no batch")
        groups = self.dynamic.run_rounds(self._next_batch(), self._extra_batch, self.batch_size, self.all_reduce_sum)
        self._top_up(version=self._latest, in_flight=self.max_staleness)  # sampled while the trainer updates
        return groups

    def _extra_batch(self) -> RolloutGroups:
        """Dynamic sampling's next batch: sampled ahead, or, with none in flight, now with the current weights."""
        if self._requested == self._collected:
            self._request(version=self._latest)
        return self._next_batch()

    def _next_batch(self) -> RolloutGroups:
        index = self._collected + 1
        while index not in self._ready:
            self._receive()
        self._collected = index
        return self._ready.pop(index)

    def publish(self, model: nn.Module, step: int) -> Dict[str, float]:
        """Send the weights after ``step`` training steps, then request the batch they are for (every rank).

        Returns:
            Dict[str, float]: ``time/weight_sync`` (gathering and queueing the weights, the trainer's cost).
        """
        t0 = time.perf_counter()
        self._send_weights(model, step)
        self._top_up(version=step)
        return {"time/weight_sync": time.perf_counter() - t0}

    def describe(self, model: nn.Module) -> str:
        """The algorithm card's line on how the worker gets the policy."""
        where = "" if self._address is None else f" at {self._address[0]}:{self._address[1]} (over TCP)"
        what = "a full CPU copy of the weights"
        if any(not p.requires_grad for p in model.parameters()):
            what = "a CPU copy of the trained weights (the frozen base once per worker)"
        return (f"{what} sent to the generation worker{where} after every training step "
                f"(max_staleness {self.max_staleness}; docs/async.md)")

    def state_dict(self) -> Dict[str, Any]:
        """The rollouts in flight (waited for) and the worker's sampling state after them, for a checkpoint."""
        while len(self._ready) < self._requested - self._collected:
            self._receive()
        return {"ready": dict(self._ready), "generator_state": self._generator_state, "collected": self._collected}

    # ---------------------------------------------------------------------------------------- internals

    def _send_weights(self, model: nn.Module, step: int) -> None:
        if self._trainable is None:
            self._split_frozen(model)
        # Copies on the CPU: the optimizer changes the parameters in place while the worker reads them.
        state = {name: t.detach().to("cpu", copy=True) for name, t in full_weights(model, self.device, self._trainable)}
        probe = None
        if self.check.due(self._versions_published):
            probe = self.check.probe(self.vocab_size, prompt=self.probe_prompt)
            was_training = model.training
            model.eval()
            with torch.no_grad():
                self._expected_probes[step] = sequence_logprobs(
                    model, torch.tensor([probe], device=self.device), chunk_size=self.chunk_size
                ).logprobs[0].cpu()
            model.train(was_training)
        self._versions_published += 1
        self._kept[step], self._latest = state, step
        self._forget_weights()
        self._requests.put(("weights", step, self._payload(step), probe))

    def _split_frozen(self, model: nn.Module) -> None:
        """Tell the trained weights from the frozen ones, and keep a CPU copy of the frozen (every rank)."""
        names = list(model.state_dict())
        trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        self._trainable = set(names) if not trainable else trainable
        if self._trainable != set(names):
            frozen = set(names) - self._trainable
            self._frozen = {n: t.detach().to("cpu", copy=True) for n, t in full_weights(model, self.device, frozen)}

    def _payload(self, version: int) -> Dict[str, torch.Tensor]:
        """Weights version ``version`` as the worker needs it: with the frozen base the first time."""
        if self._frozen is None or self._frozen_sent:
            return self._kept[version]
        self._frozen_sent = True
        return {**self._frozen, **self._kept[version]}

    def _top_up(self, version: int, in_flight: Optional[int] = None) -> None:
        """Requests with weights ``version`` until ``in_flight`` (default ``max_staleness + 1``) batches are."""
        target = self.max_staleness + 1 if in_flight is None else in_flight
        while self._requested - self._collected < target:
            self._request(version=version)

    def _request(self, version: int) -> None:
        self._requested += 1
        batch = self.prompts.next()
        self._pending[self._requested] = (batch, version)
        self._requests.put(("generate", self._requested, batch, version))

    def _forget_weights(self) -> None:
        needed = {version for _, version in self._pending.values()} | {self._latest}
        for version in [v for v in self._kept if v not in needed]:
            del self._kept[version]

    def _receive(self) -> None:
        message = self._get()
        if message[0] == "rollouts":
            _, index, groups, version, generator_state, seconds = message
            self._ready[index] = groups
            self._pending.pop(index, None)
            self._forget_weights()
            self._generator_state = generator_state
            self.busy_seconds += seconds
        elif message[0] == "probe":
            _, version, worker_logprobs = message
            diff = self.check.measure(self._expected_probes.pop(version), worker_logprobs)
            self.check.verify(self.check.reducible(diff), step=version)
        else:
            raise WorkerError(f"{self.name}: unexpected reply {message[0]!r}")

    def _get(self, replace: bool = True) -> Any:
        """The worker's next reply; a dead or silent worker is replaced (``replace``) or stops the run.

        Every :data:`~torchtune_grpo.runtime.waits.REPORT_EVERY` seconds without a reply the wait is logged (which
        worker, for how long, the limit); after ``timeout`` seconds the worker counts as silent.
        """
        report = self._wait_report()
        while True:
            closed = False  # the connection broke (a remote worker) rather than the wait timing out
            try:
                # Short slices: a worker that died is noticed (and replaced) within half a second, not after a
                # long blocking wait; the wait itself is still reported every ``report.every`` seconds.
                message = self._replies.get(timeout=min(0.5, report.every, max(0.0, self.timeout - report.waited)))
            except queue.Empty:
                message = None
            except (EOFError, OSError):  # the reply pipe broke: the worker was killed in the middle of a reply
                message, closed = None, True
                if self._process is not None:
                    self._process.join(timeout=5.0)
            if message is None:
                who = self.name if self._process is None else f"{self.name} (pid {self._process.pid})"
                if self._process is not None and not self._process.is_alive():
                    reason = f"{who} died with exit code {self._process.exitcode}"
                elif self._process is None and closed:
                    reason = f"{who} closed the connection (the worker died or was stopped)"
                elif report.waited >= self.timeout:
                    reason = (f"{who} sent nothing for {report.waited:.0f} s (limit {self.timeout:g} s, "
                              "generation_workers.timeout)")
                else:
                    report()
                    continue
                if not replace:
                    raise WorkerError(reason)
                self._replace(reason)
                report = self._wait_report()
                continue
            if message[0] == "error":  # an exception in the worker's code: a new worker would raise it again
                raise WorkerError(f"{self.name} failed:\n{message[1]}")
            return message

