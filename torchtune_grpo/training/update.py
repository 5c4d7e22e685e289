"""The policy update: one step's experience in, optimizer steps and loss statistics out.

:class:`~torchtune_grpo.training.experience.Experience` (built by the experience builder) is everything the update needs of the rows a step trains on, already in the
training layout ``[N, T]`` (column ``j`` predicts token ``start + j + 1``, see
:class:`~torchtune_grpo.training.batch.TrainingBatch`): the loss mask and kept sequences, advantages, the
old/reference/engine logprobs and any importance weights.

:class:`PolicyUpdate` runs ``ppo_epochs`` passes over it; each pass splits the rows into
``ppo_mini_batches`` disjoint mini-batches of whole groups and takes one optimizer step per mini-batch
(``ppo_epochs x ppo_mini_batches`` optimizer steps per step). Each optimizer step accumulates gradients over
micro-batches; every loss term is a sum over the micro-batch divided by the mini-batch's *global* token and
sequence counts (all ranks; one all-reduce, through the callable the recipe passes, gives the counts of
every mini-batch before the first update), so the summed gradient does not depend on the micro-batch size
or the number of processes. FSDP2 averages gradients over ranks, so the loss is multiplied by the world
size before ``backward``, and it reduce-scatters gradients only after an optimizer step's last
micro-batch. Then: the global gradient norm (clipped when ``clip_grad_norm`` is set), the optimizer and
learning-rate scheduler steps. A non-finite gradient norm is never stepped on: ``on_nonfinite="stop"`` raises
:class:`~torchtune_grpo.runtime.nonfinite.NonFiniteError`, ``"skip"`` discards the gradients and counts the step
(torchtune_grpo/runtime/nonfinite.py). The norm is global, so every rank decides the same.

With more than one mini-batch the groups are shuffled before every pass: a permutation of this rank's
groups seeded by ``(seed, step, epoch)``. Every rank holds the same number of whole groups
(``batch_size``; dynamic sampling always selects exactly that many), so every rank runs the same number of
optimizer steps and micro-batches, whatever its permutation; a group's rows never leave their rank.
New loss inputs are added to :class:`Experience` and passed in :meth:`PolicyUpdate.loss_inputs`.
"""

from contextlib import nullcontext
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtune_grpo.models.compiled import compiled_layers
from torchtune_grpo.models.logprobs import TokenLogprobs
from torchtune_grpo.metrics.sums import one_process_sum, StepSums
from torchtune_grpo.models.moe_routing import router_hooks
from torchtune_grpo.training.micro_batches import agreed_counts, count_histogram, MicroBatchPlan
from torchtune_grpo.runtime.nonfinite import advice, check_policy, NonFiniteError
from torchtune_grpo.loss.rollout_correction import logprob_mismatch_sum
from torchtune_grpo.training.batch import micro_batches, TrainingBatch
from torchtune_grpo.training.experience import Experience
from torchtune_grpo.training.routes import RouterTerms
from torchtune_grpo.training.step_metrics import LOSS_METRICS

__all__ = ["PolicyUpdate", "UpdateStats"]


class UpdateStats(NamedTuple):
    """What an update reports.

    Attributes:
        losses (Dict[str, Any]): :data:`~torchtune_grpo.training.step_metrics.LOSS_METRICS` (this rank's
            contributions to the global sums, averaged over optimizer steps; tensors or floats), plus
            ``generation/logprob_mismatch`` when the experience has engine logprobs.
        grad_norm (Optional[torch.Tensor]): the last optimizer step's global gradient norm (before
            clipping). None only when no parameter has a gradient.
        skipped_steps (int): optimizer steps not taken because the gradient norm was not finite
            (``on_nonfinite="skip"``). Default is 0.
        sums (Optional[StepSums]): a mixture-of-experts policy's router quantities of the first pass (tokens
            per expert, agreement with the engine's routes), reduced with the step's metrics. Default is None.
    """

    losses: Dict[str, Any]
    grad_norm: Optional[torch.Tensor]
    skipped_steps: int = 0
    sums: Optional[StepSums] = None


class _MicroBatchOut(NamedTuple):
    loss: Any  # the loss function's output (loss terms as global-sum contributions)
    mismatch: Any  # the engine-vs-trainer logprob mismatch sum (0.0 without engine logprobs)
    router: Dict[str, Any]  # router loss values (global-sum contributions; empty for a dense policy)


class PolicyUpdate:
    """``ppo_epochs x ppo_mini_batches`` optimizer steps on an :class:`Experience` (see the module docstring).

    Args:
        model (nn.Module): the policy (plain or FSDP2-sharded), in train mode.
        optimizer (torch.optim.Optimizer): its optimizer.
        loss_fn: a GRPO-family loss (:mod:`torchtune_grpo.loss`): ``loss_fn(logprobs, old_logprobs,
            advantages, mask, ref_logprobs=, entropy=, num_tokens=, num_seqs=[, sampler_logprobs=]
            [, importance_weights=])``.
        lr_scheduler (Optional[Any]): stepped after every optimizer step. Default is None.
        ppo_epochs (int): passes over the experience. Default is 1.
        ppo_mini_batches (int): disjoint mini-batches of whole groups per pass, one optimizer step each.
            Default is 1.
        group_size (int): ``G``, consecutive rows of one prompt (kept together in a mini-batch). Default is 1.
        seed (int): seeds the per-step shuffle of groups across mini-batches. Default is 0.
        shuffle (bool): shuffle the groups across mini-batches before every pass (with more than one
            mini-batch); False keeps the rollout order. Default is True.
        micro_batch_size (int): rows per forward/backward (with ``max_tokens_per_micro_batch``: at most).
        max_tokens_per_micro_batch (Optional[int]): micro-batches by tokens instead (padding included; see
            :mod:`~torchtune_grpo.training.micro_batches`): each mini-batch's rows sorted by length and packed up to
            this many tokens per forward, as many micro-batches on every rank (the largest count). None:
            ``micro_batch_size`` rows in rollout order. Default is None.
        clip_grad_norm (Optional[float]): clip the total gradient norm to this. Default is None.
        world_size (int): processes sharing the global batch (FSDP2 averages their gradients). Default is 1.
        all_reduce (Callable[[List[float]], List[float]]): sums a list of floats over all ranks (the recipe's
            all-reduce); called once per update, on every rank. Default is the identity (one process).
        temperature (float): the sampling temperature the logprobs are computed at. Default is 1.0.
        chunk_size (int): positions per chunk of the logprob computation. Default is 512.
        on_nonfinite (str): ``"stop"`` (raise) or ``"skip"`` (drop the optimizer step) when the gradient norm
            is NaN or infinite. Default is ``"stop"``.
        router_terms (Optional[RouterTerms]): a mixture-of-experts policy's router losses and metrics
            (:mod:`~torchtune_grpo.training.routes`); None: a dense policy. Default is None.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn,
        *,
        lr_scheduler: Optional[Any] = None,
        ppo_epochs: int = 1,
        ppo_mini_batches: int = 1,
        group_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        micro_batch_size: int,
        max_tokens_per_micro_batch: Optional[int] = None,
        clip_grad_norm: Optional[float] = None,
        world_size: int = 1,
        all_reduce: Callable[[List[float]], List[float]] = one_process_sum,
        temperature: float = 1.0,
        chunk_size: int = 512,
        on_nonfinite: str = "stop",
        router_terms: Optional[RouterTerms] = None,
    ) -> None:
        if int(ppo_epochs) < 1 or int(ppo_mini_batches) < 1:
            raise ValueError(f"ppo_epochs and ppo_mini_batches must be >= 1, got {ppo_epochs}, {ppo_mini_batches}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lr_scheduler = lr_scheduler
        self.ppo_epochs = int(ppo_epochs)
        self.ppo_mini_batches = int(ppo_mini_batches)
        self.group_size = int(group_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.micro_batch_size = int(micro_batch_size)
        self.max_tokens = None if max_tokens_per_micro_batch is None else int(max_tokens_per_micro_batch)
        self.clip_grad_norm = clip_grad_norm
        self.world_size = int(world_size)
        self.all_reduce = all_reduce
        self.temperature = temperature
        self.chunk_size = int(chunk_size)
        self.on_nonfinite = check_policy(on_nonfinite)
        self.router_terms = router_terms
        self._router_sums: Optional[StepSums] = None  # the update in progress's router metrics
        # Only a loss with truncated importance sampling takes the engine's logprobs (custom losses need not).
        self._takes_engine_logprobs = getattr(loss_fn, "tis_cap", None) is not None
        # Entropy comes from the same chunked forward (never full logits); it carries a gradient only
        # when the loss has an entropy bonus.
        self._entropy_grad = getattr(loss_fn, "entropy_coef", 0.0) > 0

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per update: ``ppo_epochs x ppo_mini_batches``."""
        return self.ppo_epochs * self.ppo_mini_batches

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the experience must carry ``pi_old``: every optimizer step after the first is off-policy."""
        return self.optimizer_steps > 1

    def mini_batches(self, exp: Experience) -> List[slice]:
        """The rows of each optimizer step of a pass: ``ppo_mini_batches`` equal slices of whole groups."""
        n, k = len(exp), self.ppo_mini_batches
        if n % (k * self.group_size):
            raise ValueError(
                f"{n} rows = {n // self.group_size} groups of {self.group_size} do not split into "
                f"ppo_mini_batches = {k} mini-batches of whole groups"
            )
        size = n // k
        return [slice(i * size, (i + 1) * size) for i in range(k)]

    def epoch_order(self, exp: Experience, step: int, epoch: int) -> Experience:
        """The experience of pass ``epoch``: groups in a permutation seeded by ``(seed, step, epoch)``.

        With one mini-batch the order cannot matter (every row is in the one optimizer step), so the rows
        stay as they are (as they do with ``shuffle=False``).
        """
        if self.ppo_mini_batches == 1 or not self.shuffle:
            return exp
        num_groups = len(exp) // self.group_size
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + epoch)
        groups = torch.randperm(num_groups, generator=gen)  # [num_groups]
        rows = (groups.unsqueeze(1) * self.group_size + torch.arange(self.group_size)).reshape(-1)  # [N]
        return exp.select(rows)

    def __call__(self, exp: Experience, step: int = 0) -> UpdateStats:
        """Run the update.

        Args:
            exp (Experience): the step's rows.
            step (int): the training step (seeds the shuffle). Default is 0.

        Returns:
            UpdateStats: loss statistics (global-sum contributions, summed on device) and the grad norm.
        """
        passes = [self.epoch_order(exp, step, e) for e in range(self.ppo_epochs)]
        slices = self.mini_batches(exp)
        # Every mini-batch's global token and sequence counts, with one all-reduce before the first update.
        local = [
            float(v)
            for ex in passes
            for rows in slices
            for v in (ex.mask[rows].sum().item(), ex.kept[rows].sum().item())
        ]
        plans = [[self._plan(ex, rows) for rows in slices] for ex in passes] if self.max_tokens else None
        if plans is not None:  # the micro-batch counts ride on the same all-reduce (their largest is used)
            size = slices[0].stop - slices[0].start
            local += [v for row in plans for p in row for v in count_histogram(len(p.sizes), size)]
        counts = self.all_reduce(local)
        if plans is not None:
            agreed = agreed_counts(counts[2 * len(passes) * len(slices) :], size)
            for e, ex in enumerate(passes):
                for m, rows in enumerate(slices):
                    if len(plans[e][m].sizes) != agreed[e * len(slices) + m]:
                        plans[e][m] = self._plan(ex, rows, agreed[e * len(slices) + m])
        stats: Dict[str, Any] = dict.fromkeys(LOSS_METRICS, 0.0)
        real = None  # [passes x mini-batches] real (not padding) tokens over all ranks: the router losses' count
        if self.router_terms is not None:
            stats.update({"moe/z_loss": 0.0, **({"moe/load_balance_loss": 0.0} if exp.expert_fractions is not None else {})})
            real = self.all_reduce([float(sum(ex.batch.lengths[rows])) for ex in passes for rows in slices])
            self._router_sums = self.router_terms.empty_sums(exp.batch.routes is not None)
            if exp.expert_fractions is None and self.router_terms.load_balance_coef:
                raise ValueError("moe.load_balance_coef > 0 needs the engine's routes (Rollout.routed_experts) to "
                                 "measure the batch's expert fractions; this engine reported none")
        mismatch = 0.0
        grad_norm, skipped = None, 0
        total_tokens = sum(counts[0 : 2 * len(slices) : 2])  # the first pass covers every row once
        for e, ex in enumerate(passes):
            for m, rows in enumerate(slices):
                i = 2 * (e * len(slices) + m)
                if plans is None:
                    sub, mbs = ex, micro_batches(rows.stop, self.micro_batch_size, rows.start)
                else:  # the mini-batch's rows in the plan's order: each micro-batch a slice of them
                    plan = plans[e][m]
                    sub = ex.select(torch.tensor([rows.start + r for r in plan.order], dtype=torch.long),
                                    row_width=plan.row_width)
                    mbs = plan.slices()
                num_real = real[e * len(slices) + m] if real is not None else 0.0
                out = self._accumulate(sub, mbs, counts[i], counts[i + 1], stats, num_real, first_pass=e == 0)
                if e == 0 and ex.engine_logprobs is not None:
                    mismatch = mismatch + out / max(total_tokens, 1)
                grad_norm, stepped = self._optimizer_step(step, e, m)
                skipped += not stepped
        if exp.engine_logprobs is not None:
            stats["generation/logprob_mismatch"] = mismatch
        router_sums, self._router_sums = self._router_sums, None
        return UpdateStats(stats, grad_norm, skipped, router_sums)

    def _plan(self, exp: Experience, rows: slice, num_micro_batches: Optional[int] = None) -> MicroBatchPlan:
        """The token-budget micro-batches of mini-batch ``rows`` (indices relative to ``rows.start``)."""
        sub = exp.batch
        if (rows.start, rows.stop) != (0, len(exp)):
            sub = sub.select(list(range(rows.start, rows.stop)))
        return sub.plan(max_tokens=self.max_tokens, max_rows=self.micro_batch_size, num_micro_batches=num_micro_batches)

    def _accumulate(
        self, exp: Experience, mbs: List[slice], num_tokens: float, num_seqs: float, stats: Dict[str, Any],
        num_real: float = 0.0, first_pass: bool = True,
    ):
        """Forward/backward over the micro-batches ``mbs`` (row slices of ``exp``) of one optimizer step; adds
        to ``stats``, returns the mismatch sum. ``num_real``: the mini-batch's real tokens over all ranks (router
        losses); ``first_pass``: the router metrics are counted on the first pass over the rows only."""
        mismatch = 0.0
        for i, mb in enumerate(mbs):
            # Reduce-scatter gradients only after the last micro-batch.
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(i == len(mbs) - 1)
            # compile_training's layers stay in use through backward: a checkpointed layer is recomputed there,
            # and must recompute with the forward it saved tensors for (models/compiled.py).
            with compiled_layers(self.model):
                out = self._micro_batch(exp, mb, num_tokens, num_seqs, num_real, first_pass)
            mismatch += out.mismatch
            for key in LOSS_METRICS:
                stats[key] = stats[key] + getattr(out.loss, key).detach() / self.optimizer_steps
            for key, value in out.router.items():
                stats[key] = stats[key] + value / self.optimizer_steps
        return mismatch

    def _micro_batch(
        self, exp: Experience, mb: slice, num_tokens: float, num_seqs: float, num_real: float = 0.0,
        first_pass: bool = True,
    ) -> "_MicroBatchOut":
        """Forward, loss and backward of micro-batch ``mb`` (the replayed routes, if any, stay forced through
        backward: an activation-checkpointed layer recomputes its forward there)."""
        with exp.batch.routing(self.model, mb, self._allow_layout):
            return self._forward_backward(exp, mb, num_tokens, num_seqs, num_real, first_pass)

    def _forward_backward(
        self, exp: Experience, mb: slice, num_tokens: float, num_seqs: float, num_real: float, first_pass: bool,
    ) -> "_MicroBatchOut":
        mismatch = 0.0
        hooks = router_hooks(self.model) if self.router_terms is not None else None
        with hooks.collecting() if hooks is not None else nullcontext() as collected:
            out_lp = exp.batch.logprobs(
                self.model,
                mb,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=True,
                entropy_grad=self._entropy_grad,
                allow_layout=self._allow_layout,
            )
        old = exp.old_logprobs[mb] if exp.old_logprobs is not None else out_lp.logprobs.detach()
        if exp.engine_logprobs is not None:
            # The trainer's pi_old vs the engine's sampling logprobs of the same tokens.
            mismatch += logprob_mismatch_sum(old, exp.engine_logprobs[mb], exp.mask[mb])
        inputs = self.loss_inputs(exp, mb, out_lp)
        out = self.loss_fn(
            out_lp.logprobs, old, exp.advantages[mb], exp.mask[mb], num_tokens=num_tokens, num_seqs=num_seqs,
            **inputs,
        )
        total, router = out.loss, {}
        if collected is not None:
            extra, lb, z = self.router_terms.micro_batch(
                collected, exp.batch.real_mask(mb, self.model, self._allow_layout),
                exp.batch.routes_for(mb, self.model, self._allow_layout), exp.expert_fractions, num_real,
                self._router_sums if first_pass else None,
            )
            total = total + extra
            router = {"moe/z_loss": z, **({"moe/load_balance_loss": lb} if exp.expert_fractions is not None else {})}
        # FSDP averages gradients over ranks; the loss is already a global sum.
        (total * self.world_size).backward()
        return _MicroBatchOut(out, mismatch, router)

    @property
    def _allow_layout(self) -> bool:
        """Whether the training forwards may run the batch's layout (shared-prompt or packed rows).

        Not with router losses (a mixture of experts' ``moe.load_balance_coef`` / ``moe.z_loss_coef``): they are
        sums over every token of every sequence (normalised by that count), and a layout holds a shared prompt
        once and no response's last token, so those micro-batches run one row per sequence. The router metrics
        alone (coefficients 0) are counted over the tokens the forward holds.
        """
        terms = self.router_terms
        return terms is None or not (terms.load_balance_coef or terms.z_loss_coef)

    def loss_inputs(self, exp: Experience, mb: slice, out_lp: TokenLogprobs) -> Dict[str, Any]:
        """The loss's keyword inputs for micro-batch ``mb`` (``out_lp``: its logprobs and entropy), counts aside."""
        inputs: Dict[str, Any] = {
            "ref_logprobs": exp.ref_logprobs[mb] if exp.ref_logprobs is not None else None,
            "entropy": out_lp.entropy,
        }
        if exp.engine_logprobs is not None and self._takes_engine_logprobs:
            inputs["sampler_logprobs"] = exp.engine_logprobs[mb]
        if exp.importance_weights is not None:
            inputs["importance_weights"] = exp.importance_weights[mb]
        return inputs

    def _optimizer_step(self, step: int, epoch: int, mini_batch: int) -> "tuple[Optional[torch.Tensor], bool]":
        """Clip (or only measure) the gradients, then step; returns the global norm and whether it stepped.

        Raises:
            NonFiniteError: when the norm is NaN or infinite and ``on_nonfinite`` is ``"stop"``.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = None
        if params:
            # The norm before clipping; with FSDP2 a DTensor over the shards, made global (the same on every
            # rank, so every rank takes the same decision below).
            if self.clip_grad_norm is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=float(self.clip_grad_norm))
            else:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
        finite = grad_norm is None or bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not finite and self.on_nonfinite == "stop":
            raise NonFiniteError(advice(
                f"The gradient norm is {float(grad_norm)} at training step {step + 1} (ppo epoch {epoch}, "
                f"mini-batch {mini_batch}); the optimizer step was not taken"
            ))
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()  # also after a skipped step: the schedule follows the training steps
        return grad_norm, finite
