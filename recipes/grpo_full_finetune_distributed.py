# torchtune-grpo: GRPO full fine-tuning on one or many processes (FSDP2).
#
#   tune run grpo_full_finetune_distributed --config configs/tiny/full_grpo_cpu.yaml
#   tune run --nproc_per_node 8 grpo_full_finetune_distributed --config my.yaml
#
# This file is installed as a top-level module, so `tune run` finds it from any directory.
"""GRPO (Group Relative Policy Optimization, Shao et al. 2024, arXiv:2402.03300), full fine-tuning.

One step, on every rank (:class:`~torchtune_grpo.training.step.GRPOStep`), and the object that carries it from
one stage to the next::

    batch_size prompts -> group_size completions each, scored        RolloutGroups  (torchtune_grpo/rollouts/groups.py)
      [dynamic sampling: drop zero-variance groups, more rounds on new prompts until the batch is full]
      -> training layout, reference logprobs (frozen initial policy; none when kl_coef == 0) and old logprobs
      -> [KL penalty in the reward] -> advantages (group-relative, RLOO, batch std, ...)
                                                                     Experience     (torchtune_grpo/training/experience.py)
      -> ppo_epochs x (micro-batched clipped loss + KL + entropy bonus, backward) -> clip grads -> step
      -> weight sync to an engine with its own weights (vLLM) -> metrics -> checkpoint

Global batch per step: ``batch_size x world_size`` prompts, ``x group_size`` sequences. Losses are
normalised by global token/sequence counts, so the update does not depend on how the batch is split over
micro-batches or processes. The variants (GRPO, Dr. GRPO, DAPO, GSPO, ...) are config: see
docs/algorithms.md and the ``algorithm_card.md`` every run writes to its output directory.

The class reads in the order of a run: ``__init__`` (config, engine, process group), ``setup`` (everything
built, a checkpoint restored), ``train`` (the loop: :meth:`train_step`, evaluation, checkpoints),
``save_checkpoint``, ``cleanup``. Public after ``setup``, for tests and benchmarks: ``config``, ``model``,
``tokenizer``, ``optimizer``, ``engine``, ``prompts``, ``step`` (its stages are swappable, e.g.
``recipe.step.rollouts = FixedRollouts(...)``), ``global_step`` and :meth:`train_step`. A subclass (the
LoRA recipe) overrides only the hooks: :meth:`check_engine`, :meth:`build_models`,
:meth:`gather_model_state` and :meth:`write_model_files` (docs/architecture.md).
"""

import dataclasses
import os
import shutil
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any, ContextManager, Dict, NamedTuple, Optional

# First: drops torchao's import-time line before torchtune imports it (torchtune_grpo/runtime/quiet.py).
import torchtune_grpo.runtime.quiet  # noqa: F401, I001

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from torchtune_grpo.config.algorithm_card import AlgorithmSpec, write_algorithm_card
from torchtune_grpo.assets import register_resolvers
from torchtune_grpo.checkpoints.manager import (
    capture_training_state, CheckpointManager, restore_training_state, restored_rollouts,
)
from torchtune_grpo.checkpoints.checkpointer_facts import epoch_output_dir, instantiate_checkpointer
from torchtune_grpo.checkpoints.storage import checkpoint_retention, model_files
from torchtune_grpo.runtime.collectives import Collectives, init_process_group
from torchtune_grpo.config import build_multi_turn, instantiate_component, RecipeConfig
from torchtune_grpo.runtime.crash_points import crash_point
from torchtune_grpo.training.diagnostics import StepDiagnostics
from torchtune_grpo.rollouts.group_selection import DynamicSampling
from torchtune_grpo.rollouts.evaluation import check_evaluation_keys, correctness_name, HeldOutEvaluation
from torchtune_grpo.training.experience import ExperienceBuilder, Reference
from torchtune_grpo.generation import (
    check_engine, GenerationEngine, request_routes, WeightPublisher, WeightSyncCheck,
)
from torchtune_grpo.loss.masks import LossMasks
from torchtune_grpo.runtime.compute import set_tf32
from torchtune_grpo.runtime.model_setup import build_model, check_device, Placement
from torchtune_grpo.models import drop_pad_input_embedding_grad, image_state_dict
from torchtune_grpo.runtime.nonfinite import advice, NonFiniteError
from torchtune_grpo.loss.rollout_correction import off_policy_note, RolloutCorrection
from torchtune_grpo.runtime.output_lock import check_output_dir, OutputDirLock
from torchtune_grpo.runtime.precision import Precision
from torchtune_grpo.runtime.preemption import SIGTERM_EXIT_CODE, StopOnSigterm
from torchtune_grpo.runtime.image_setup import attach_image_side
from torchtune_grpo.runtime.reference_setup import build_reference, ReferenceOptions
from torchtune_grpo.rollouts.producer import PromptStream, RolloutProducer
from torchtune_grpo.checkpoints.resume import config_changes, earlier_run_note, save_start_config
from torchtune_grpo.rewards import build_reward_set
from torchtune_grpo.metrics.run_logs import RunLogs
from torchtune_grpo.runtime.sharding import gather_full_state_dict, unsharded
from torchtune_grpo.loss.token_selection import HighEntropyTokens
from torchtune_grpo.training.batch import training_layout
from torchtune_grpo.training.routes import RouterTerms
from torchtune_grpo.training.step import count_nonfinite_weights, GRPOStep, StepResult
from torchtune_grpo.training.update import PolicyUpdate
from torchtune_grpo.workers.client import WorkerRollouts
from torchtune_grpo.workers.config_checks import check_generation_workers

log = utils.get_logger("INFO")
register_resolvers()  # ${grpo_asset:...} in shipped configs

_PROFILER_OFF = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False}


class Models(NamedTuple):
    """What :meth:`GRPOFullFinetuneRecipeDistributed.build_models` returns.

    Attributes:
        policy (torch.nn.Module): the trained model.
        reference (Optional[Reference]): what the KL term is measured against; None without a KL term.
        checkpointer (Any): the torchtune checkpointer that writes the run's model files.
        reference_description (str): what the reference is, for the algorithm card and the log.
        image_source (Optional[str]): with images in the prompt, the directory the policy's vision tower comes
            from; None: the step being resumed, else the source (the LoRA recipe's: always the source).
        image_file (Optional[Path]): trained vision tensors to load over it (a resumed LoRA run's). Default is None.
    """

    policy: torch.nn.Module
    reference: Optional[Reference]
    checkpointer: Any
    reference_description: str = "loaded (frozen copy of the initial policy)"
    image_source: Optional[str] = None
    image_file: Optional[Path] = None


class GRPOFullFinetuneRecipeDistributed(FTRecipeInterface):
    """GRPO full fine-tuning, FSDP2-sharded across processes. See the module docstring and ``docs/``.

    Args:
        cfg (DictConfig): the run's config (see ``configs/tiny/full_grpo_cpu.yaml`` for every key).
    """

    # Every key this recipe reads, with its default and range (torchtune_grpo/config/schema.py; the LoRA
    # recipe's adds its own).
    config_class = RecipeConfig

    @classmethod
    def known_keys(cls) -> set:
        """Top-level config keys this recipe reads (its ``config_class``'s fields)."""
        return cls.config_class.keys()

    def __init__(self, cfg: DictConfig) -> None:
        # Checked (the errors name key and value) and typed, defaults applied. ``cfg`` stays for
        # instantiating components.
        self.config = c = self.config_class.from_cfg(cfg)
        # The engine first: a recipe that cannot use it says so before any process group exists.
        engine = request_routes(config.instantiate(cfg.generation), c.moe.routing_replay)  # vLLM's MoE routes
        self.engine: GenerationEngine = self.check_engine(check_engine(engine), cfg)
        if not float(self.engine.temperature) > 0:  # a custom engine's default; the config's is checked
            raise ValueError(f"generation.temperature must be > 0 for training, got {self.engine.temperature} "
                             f"({type(self.engine).__name__}'s): greedy groups hold G copies of one completion.")
        check_generation_workers(c, self.engine)
        check_device(c.device)  # torchtune's get_device falls back to the CPU without a word
        device = utils.get_device(device=c.device)
        init_process_group(device.type)  # a one-process group for a `tune run` without --nproc_per_node
        self.world_size, self.rank = utils.get_world_size_and_rank()
        # dtype: fp32 | bf16 (fp32 master weights, bf16 compute) | bf16_pure (torchtune_grpo/runtime/precision.py)
        self._placement = Placement.from_config(c, device, self.world_size, self.precision(c))
        set_tf32(c.tf32)  # the update's switches (activation checkpointing, logprob_head, compile): Placement
        self._dist = Collectives(device, self.world_size)
        # Faults (docs/recipe.md, "What survives what"; torchtune_grpo/runtime/nonfinite.py, checkpoints/resume.py, runtime/preemption.py)
        self.sigterm = StopOnSigterm(c.save_on_sigterm)
        self._output_lock = OutputDirLock(c.output_dir)
        # step_N directories: when to save, writing, pruning, resuming (torchtune_grpo/checkpoints/manager.py)
        self._checkpoints = CheckpointManager(
            c.output_dir, self.write_model_files, save_every_n_steps=c.save_every_n_steps,
            keep_last_n=checkpoint_retention(c.keep_last_n_checkpoints), on_broken=c.on_broken_checkpoint,
            discard_partial=lambda step: shutil.rmtree(epoch_output_dir(self._checkpointer, step), ignore_errors=True),
        )
        # Saved in every checkpoint: a resume lists the settings changed since.
        self._config_record = OmegaConf.to_container(cfg, resolve=True)
        self.seed = training.set_seed(seed=c.seed)
        self.global_step = 0

    @property
    def _is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def _device(self) -> torch.device:
        return self._placement.device

    # ======================================================================================= hooks

    @staticmethod
    def precision(config: Any) -> Precision:
        """The training precision (a hook: LoRA trains every weight in the compute dtype)."""
        return Precision.from_name(config.dtype)

    def check_engine(self, engine: GenerationEngine, cfg: DictConfig) -> GenerationEngine:
        """The generation engine, if this recipe can train with it (a hook: LoRA refuses some)."""
        return engine

    def build_models(self, cfg: DictConfig, base_checkpointer: Any, resume_dir: Optional[Path]) -> Models:
        """The policy (from ``resume_dir`` when resuming), the reference and the checkpointer (a hook: LoRA
        builds base weights + adapters and uses the policy with its adapters off as the reference)."""
        checkpointer = base_checkpointer
        if resume_dir is not None:
            checkpointer = instantiate_checkpointer(
                cfg, checkpoint_dir=str(resume_dir), checkpoint_files=model_files(resume_dir)
            )
        policy_state = checkpointer.load_checkpoint()[training.MODEL_KEY]
        source = str(resume_dir) if resume_dir is not None else checkpoint_source(cfg)
        max_len = (self.config.max_prompt_length or 0) + self.config.max_response_length
        policy = build_model(cfg.model, policy_state, self._placement, trainable=True, source=source, max_len=max_len)
        # The reference is the *initial* policy, also after a resume. With kl_coef == 0 it is never
        # used: don't spend its memory.
        # reference: its precision and offloading (torchtune_grpo/runtime/reference_setup.py).
        reference, options = None, ReferenceOptions(**dataclasses.asdict(self.config.reference))
        if self.config.kl_coef > 0:
            ref_state = policy_state if resume_dir is None else base_checkpointer.load_checkpoint()[training.MODEL_KEY]
            reference = Reference(build_reference(
                cfg.model, ref_state, self._placement, options, source=checkpoint_source(cfg), max_len=max_len
            ))
        return Models(policy, reference, checkpointer, options.describe(self._placement.precision.compute_dtype))

    def gather_model_state(self) -> Dict[str, Any]:
        """The full model state dict on rank 0's CPU (other ranks: empty); a hook (LoRA: maybe adapters only)."""
        # A trained vision tower or projector (train_vision) under the checkpoint's own names.
        return image_state_dict(self.model, gather_full_state_dict(self.model, self._is_rank_zero, self._device))

    def write_model_files(self, model_state: Dict[str, Any], staging: Path, step: int) -> None:
        """Write the checkpoint's model files as the directory ``staging`` (a hook: LoRA adds its adapter)."""
        written = epoch_output_dir(self._checkpointer, step)
        shutil.rmtree(written, ignore_errors=True)  # left by a killed save
        self._checkpointer.save_checkpoint({training.MODEL_KEY: model_state}, epoch=step, intermediate_checkpoint=False)
        os.replace(written, staging)

    # ================================================================================================ setup

    def setup(self, cfg: DictConfig) -> None:
        """Build everything from the config and, when resuming, restore the latest checkpoint.

        Everything that can fail on the config alone (output directory, resume checkpoint, rewards vs
        ``eval_reward``, loss arguments) fails before a model is built.
        """
        c = self.config
        recipe_state, resume_dir = self._resume_point()
        self._logs = RunLogs(
            c.output_dir, config.instantiate(cfg.metric_logger) if self._is_rank_zero else None, c.log_every_n_steps
        )
        self._logs.log_config(cfg)
        rewards = build_reward_set(cfg.reward_functions, fallback=c.reward_fallback)
        if note := check_evaluation_keys(cfg, c.validation is not None, rewards.names, c.eval_reward):
            utils.log_rank_zero(log, note)
        correct = correctness_name(rewards.names, c.eval_reward) if c.step_diagnostics else None  # fails now
        advantage = instantiate_component(cfg, "advantage")
        kl_in_reward = c.kl_coef > 0 and c.kl_placement == "reward"
        loss_fn = instantiate_component(
            cfg, "loss", kl_coef=0.0 if kl_in_reward else c.kl_coef, kl_estimator=c.kl_estimator,
            max_response_length=c.max_response_length,
        )
        # Masks and weights decided from pi_old before the update (torchtune_grpo/loss/masks.py).
        rc_cfg, ts_cfg = c.rollout_correction, c.token_selection
        loss_masks = LossMasks(
            RolloutCorrection(**rc_cfg) if rc_cfg is not None else None,
            HighEntropyTokens(**ts_cfg) if ts_cfg is not None else None,
        )
        note = off_policy_note(getattr(loss_fn, "tis_cap", None), type(self.engine).__name__, self.engine.holds_weights)
        if note and rc_cfg is None:  # rollout_correction is the other answer to the mismatch
            utils.log_rank_zero(log, note)

        models = self.build_models(cfg, instantiate_checkpointer(cfg), resume_dir)
        self.model, self._checkpointer = models.policy, models.checkpointer
        reference = models.reference if c.kl_coef > 0 else None
        utils.log_rank_zero(log, "Reference model: "
                            f"{models.reference_description if reference else 'none (kl_coef = 0)'}")
        share_prompt, note = training_layout(  # prompts shared in training forwards (training/batch.py)
            self.model, share_prompt=c.share_prompt_in_training, explicit="share_prompt_in_training" in cfg,
            max_prompt_length=c.max_prompt_length, max_response_length=c.max_response_length,
            group_size=c.group_size, micro_batch_size=c.micro_batch_size, pack=c.pack_sequences_in_training,
        )
        if note:
            utils.log_rank_zero(log, note)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        if c.drop_pad_embedding_grad:  # TRL's behaviour (docs/algorithms.md)
            drop_pad_input_embedding_grad(self.model, self.tokenizer.pad_id)
            utils.log_rank_zero(
                log, f"drop_pad_embedding_grad: the pad token's (id {self.tokenizer.pad_id}) input embedding "
                "gets no gradient where it is an input, as transformers' padding_idx"
            )
        # Multi-turn episodes (docs/multi_turn.md): set before the datasets tokenize their prompts, which
        # then list the environment's tools.
        multi_turn = build_multi_turn(c)
        if multi_turn is not None:
            if note := multi_turn.attach(self.tokenizer):  # fails now if the chat template cannot be continued
                utils.log_rank_zero(log, note)
            utils.log_rank_zero(
                log, f"Multi-turn episodes: {type(multi_turn.environment).__name__}, at most {multi_turn.max_turns} "
                f"turns, replies rendered by {type(multi_turn.turns_for(self.tokenizer)).__name__}",
            )
        self.optimizer = instantiate_component(cfg, "optimizer", self.model.parameters())
        # This rank's prompts across epochs (torchtune_grpo/rollouts/producer.py).
        dataset = config.instantiate(cfg.dataset, self.tokenizer)
        image_source = None  # the directory the policy's vision tower comes from, with images in the prompt
        if "image_inputs" in dataset[0]:  # images in the prompt (docs/multimodal.md)
            image_source = models.image_source or (str(resume_dir) if resume_dir else checkpoint_source(cfg))
            utils.log_rank_zero(log, attach_image_side(
                self.model, None if reference is None else reference.model, self.optimizer,
                engine=self.engine, train=c.train_vision, device=self._device, trained_file=models.image_file,
                shard=partial(self._placement.shard_added, self.model),
                reference_source=checkpoint_source(cfg), policy_source=image_source,
                workers=c.generation_workers.enabled))
        elif c.train_vision != "none":
            raise ValueError(f"train_vision: {c.train_vision}, but the dataset has no images (docs/multimodal.md)")
        self.prompts = PromptStream.over(
            dataset, batch_size=c.batch_size, world_size=self.world_size, rank=self.rank, shuffle=c.shuffle,
            seed=self.seed,
        )
        utils.log_rank_zero(
            log, f"{len(dataset)} prompts; global batch per step = batch_size {c.batch_size} x "
            f"{self.world_size} rank(s) x group_size {c.group_size} = "
            f"{c.batch_size * self.world_size * c.group_size} sequences",
        )
        self.total_steps = c.max_steps if c.max_steps is not None else c.epochs * len(self.prompts)
        # An engine with its own copy of the weights (vLLM) gets the trainer's after every optimizer step,
        # and a check that it really has them (docs/vllm.md). The native engine samples with self.model.
        publisher = None
        if self.engine.holds_weights:
            publisher = WeightPublisher(
                self.engine, config.instantiate(c.weight_sync) if c.weight_sync is not None else WeightSyncCheck(),
                probe_prompt=dataset[0]["tokens"],  # the same on every rank and every check
                device=self._device, all_reduce_max=self._dist.max, chunk_size=c.logprob_chunk_size,
                trainer_dtype=self._placement.precision.compute_dtype,  # the engine's dtype follows it unless set
            )
        self.evaluation = None  # held-out evaluation: this rank's share of the validation prompts
        if c.validation is not None:
            validation = config.instantiate(cfg.validation, self.tokenizer)
            self.evaluation = HeldOutEvaluation.from_config(
                c, validation, rank=self.rank, world_size=self.world_size, tokenizer=self.tokenizer,
                engine=self.engine, rewards=rewards, all_reduce_sum=self._dist.sum, seed=self.seed,
                device=self._device, multi_turn=multi_turn,
            )
            utils.log_rank_zero(log, f"Held-out evaluation on {self.evaluation.num_prompts} validation prompts")
        lr_scheduler = None
        if c.lr_scheduler is not None:
            lr_scheduler = instantiate_component(
                cfg, "lr_scheduler", self.optimizer, last_epoch=-1,
                # the schedule counts optimizer steps: ppo_epochs x ppo_mini_batches per training step
                num_training_steps=self.total_steps * c.ppo_epochs * c.ppo_mini_batches,
            )
        temperature = float(self.engine.temperature)  # logprobs of the distribution sampled from, as in the ratio
        # The update core (torchtune_grpo/training/update.py): micro-batched loss with global normalisation,
        # FSDP2 gradient sync, clipping, optimizer and scheduler steps.
        # A mixture-of-experts policy's router losses and metrics, and routing replay (training/routes.py).
        router = RouterTerms.for_model(self.model, c.moe.load_balance_coef, c.moe.z_loss_coef)
        replay_mode = c.moe.routing_replay if router is not None else None  # None: a dense policy
        update = PolicyUpdate(
            self.model, self.optimizer, loss_fn, lr_scheduler=lr_scheduler, ppo_epochs=c.ppo_epochs,
            ppo_mini_batches=c.ppo_mini_batches, group_size=c.group_size, seed=self.seed,
            shuffle=c.ppo_mini_batch_shuffle, micro_batch_size=c.micro_batch_size,
            max_tokens_per_micro_batch=c.max_tokens_per_micro_batch, clip_grad_norm=c.clip_grad_norm,
            world_size=self.world_size, all_reduce=self._dist.sum, temperature=temperature,
            chunk_size=c.logprob_chunk_size, on_nonfinite=c.on_nonfinite, router_terms=router,
        )
        dynamic = DynamicSampling(**dataclasses.asdict(c.dynamic_sampling))
        # One generator per rank, so ranks draw different samples for their different prompts.
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(self.seed + self.rank)
        rollouts = producer = RolloutProducer(  # the step's scored rollouts (torchtune_grpo/rollouts/producer.py)
            engine=self.engine, tokenizer=self.tokenizer, rewards=rewards, prompts=self.prompts,
            group_size=c.group_size, batch_size=c.batch_size, max_new_tokens=c.max_response_length,
            generator=self._generator, dynamic=dynamic, multi_turn=multi_turn,
            generation_context=self.generation_context, all_reduce_sum=self._dist.sum,
        )
        if c.generation_workers.enabled:  # rollouts (and the weights) through a worker process (docs/async.md)
            rollouts = publisher = WorkerRollouts.from_config(
                c, self._config_record, self.prompts, rank=self.rank, world_size=self.world_size, seed=self.seed,
                device=self._device,
                dtype=self._placement.precision.compute_dtype, probe_prompt=dataset[0]["tokens"],
                vocab_size=self.model.tok_embeddings.num_embeddings, dynamic=dynamic, all_reduce_sum=self._dist.sum,
                image_source=image_source,  # the worker's copy gets the same image side
            )
        self.step = GRPOStep(
            rollouts=rollouts,
            dynamic=dynamic,
            build_experience=ExperienceBuilder(  # selected rollouts -> the update's input (training/experience.py)
                advantage=advantage, reward_weights=rewards.weights, group_size=c.group_size,
                pad_id=self.tokenizer.pad_id, loss_masks=loss_masks, micro_batch_size=c.micro_batch_size,
                temperature=temperature, device=self._device, chunk_size=c.logprob_chunk_size,
                share_prompt=share_prompt, pack_sequences=c.pack_sequences_in_training,
                packed_attention=c.packed_attention,
                max_tokens_per_micro_batch=c.max_tokens_per_micro_batch,
                mask_truncated=c.mask_truncated_completions, kl_coef=c.kl_coef,
                kl_estimator=c.kl_estimator, kl_in_reward=kl_in_reward, reference=reference,
                update_needs_old_logprobs=update.needs_old_logprobs or c.step_diagnostics, all_reduce=self._dist.sum,
                all_gather=self._dist.gather_cat, routing_replay=replay_mode == "rollout",
                num_experts=router.num_experts if router is not None else None,
            ),
            update=update, publisher=publisher, all_reduce=self._dist.all_reduce, batch_size=c.batch_size,
            log_completions=c.log_completions, on_nonfinite=c.on_nonfinite, device=self._device,
            max_staleness=c.generation_workers.max_staleness if c.generation_workers.enabled else 0,
        )
        if c.step_diagnostics:  # closed-loop diagnostics (torchtune_grpo/training/diagnostics.py)
            self.step.diagnostics = StepDiagnostics(
                correct, c.eval_threshold, greedy=producer.greedy, logprobs=self.step.build_experience.planned_logprobs
            )
        in_flight = None
        if recipe_state is not None:
            self.global_step, self.prompts.epoch = recipe_state["step"], recipe_state["epoch"]
            in_flight = restored_rollouts(recipe_state, self.rank, self.world_size)
            restarted = restore_training_state(
                recipe_state, model=self.model, optimizer=self.optimizer, lr_scheduler=lr_scheduler,
                dataloader=self.prompts.dataloader, generator=self._generator, device=self._device, rank=self.rank,
                world_size=self.world_size,
            )
            if restarted:  # another number of processes: the data position converted, the RNG streams restarted
                utils.log_rank_zero(log, restarted)
        self._profiler, _ = config.instantiate(c.profiler or OmegaConf.create(_PROFILER_OFF))
        spec = AlgorithmSpec.from_run(  # what the run optimises, for its algorithm card
            c, loss=loss_fn, advantage=advantage, rewards=rewards, optimizer=self.optimizer,
            lr_schedule=cfg.lr_scheduler._component_ if lr_scheduler is not None else None,
            world_size=self.world_size, precision=self._placement.precision.describe(),
            policy_model=getattr(self.model, "backend_note", None),
            reference_description=models.reference_description if reference is not None else None,
            dynamic=dynamic, multi_turn=multi_turn, routing_replay=replay_mode,
            weight_sync=publisher.describe(self.model) if publisher is not None else None,
            formula_lines=loss_masks.formula_lines(),
        )
        if self._is_rank_zero:
            card = write_algorithm_card(spec, c.output_dir)
            log.info("Algorithm card (also in %s/algorithm_card.md):\n%s", c.output_dir, card)
        if c.generation_workers.enabled:
            # Its weights, and the first max_staleness + 1 batches requested (or the checkpoint's in flight).
            rollouts.start(self.model, self.global_step, in_flight=in_flight)
            utils.log_rank_zero(
                log, f"Generation worker started (max_staleness {c.generation_workers.max_staleness}); "
                f"{'rollouts in flight restored' if in_flight else 'first batches requested'}"
            )
        elif publisher is not None:
            # The engine started from checkpoint_dir; a resumed or converted policy may differ from it.
            sync = publisher.publish(self.model, step=self.global_step)
            utils.log_rank_zero(log, f"Generation engine started, weights synced and checked: {sync}")

    def _resume_point(self) -> "tuple[Optional[Dict[str, Any]], Optional[Path]]":
        """Take the output directory, recover what killed saves left, and find the checkpoint to resume
        (``resume_from_checkpoint``): its training state and directory, or ``(None, None)``."""
        c = self.config
        if self._is_rank_zero:
            check_output_dir(c.output_dir)
            self._output_lock.acquire()  # one run per output_dir; raises naming the run that holds it
            for line in self._checkpoints.recover():  # what killed saves left (a save the disk filled up)
                log.info(f"Checkpoints: {line}")
        dist.barrier()
        resume = None
        if c.resume_from_checkpoint:  # every rank reads the same checkpoint; rank 0 cuts the logs back
            resume, done = self._checkpoints.resume_point(cut_logs=self._is_rank_zero)
            for note in resume.notes if self._is_rank_zero else []:
                log.warning(f"Checkpoints: {note}")
            for line in done:
                log.info(line)
        if self._is_rank_zero:
            if resume is None and (note := earlier_run_note(c.output_dir)):
                log.warning(note)
            path = save_start_config(c.output_dir, self._config_record, resume.step if resume else None)
            log.info(f"This start's config: {path}")
        if resume is None:
            return None, None
        utils.log_rank_zero(log, f"Resuming from {resume.directory}")
        if changed := config_changes(resume.state.get("config"), self._config_record):
            utils.log_rank_zero(
                log, f"Settings changed since {resume.directory.name} was saved (the run continues with the new "
                f"ones): {'; '.join(changed)}"
            )
        if resume.state["seed"] != self.seed:  # the seed decides the data order: restored before the sampler
            utils.log_rank_zero(log, f"Using the checkpoint's seed {resume.state['seed']}, not {self.seed}")
            self.seed = training.set_seed(seed=resume.state["seed"])
        return resume.state, resume.directory

    # ============================================================================================= the loop

    def train(self) -> None:
        """Run GRPO steps until ``max_steps`` (or ``epochs`` x batches per epoch), or until SIGTERM.

        On SIGTERM (``save_on_sigterm``) the current step is finished, a checkpoint saved and the loop left;
        ``self.sigterm.stopped`` then says so (``run_recipe`` exits with 143).
        """
        self.sigterm.install()
        if self._device.type == "cuda":
            training.cleanup_before_training()  # empty_cache; torch.cpu has none
        self.optimizer.zero_grad(set_to_none=True)
        pbar = tqdm(
            total=self.total_steps, initial=self.global_step, disable=not self._is_rank_zero, desc="GRPO",
            dynamic_ncols=True,
        )
        self._profiler.start()
        if self.evaluation is not None:
            self.evaluate()  # step 0 (or the resumed step): the baseline
        # max_steps (when set) wins over epochs; the data then cycles for as many epochs as needed.
        while self.global_step < self.total_steps:
            metrics = self.train_step().metrics
            pbar.update(1)
            pbar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}")
            self._profiler.step()
            if self.sigterm.agreed(self._dist.sum):  # any rank got SIGTERM: all save this step, stop
                utils.log_rank_zero(log, f"Stopping on SIGTERM after step {self.global_step}: saving a checkpoint")
                self.save_checkpoint(self.global_step)
                self.sigterm.stopped = True
                break
            if self._checkpoints.is_due(self.global_step, self.total_steps):
                self.save_checkpoint(self.global_step)
            if self.evaluation is not None and self.evaluation.due(self.global_step, self.total_steps):
                self.evaluate()
        self._profiler.stop()
        pbar.close()
        if self.sigterm.stopped:
            return
        if self.evaluation is not None:
            self.evaluate()  # the end
        self.save_checkpoint(self.global_step)

    def train_step(self) -> StepResult:
        """One GRPO step on the next prompts, logged (what :meth:`train` repeats; public for benchmarks)."""
        result = self.step(self.model, self.global_step)
        self.global_step += 1
        self._logs.step(self.global_step, result.metrics, result.samples)
        crash_point("logged", self.global_step)  # test-only (torchtune_grpo/runtime/crash_points.py)
        return result

    def generation_context(self) -> ContextManager:
        """Around each generation call: the policy's parameters gathered once per rollout rather than once per
        decoded token; nothing for an engine with its own copy of the weights."""
        if self.engine.holds_weights:
            return nullcontext()
        return unsharded(self.model, self._placement.reshard_after_forward)

    def evaluate(self) -> Dict[str, float]:
        """Held-out metrics ``eval/*`` (greedy accuracy, mean reward, pass@k), logged; the same on every rank."""
        metrics = self.evaluation(self.model, self.generation_context)
        self._logs.evaluation(self.global_step, metrics)
        shown = ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "eval/num_prompts")
        utils.log_rank_zero(log, f"Held-out evaluation at step {self.global_step}: {shown}")
        return metrics

    # ====================================================================================== checkpoints

    def save_checkpoint(self, step: int) -> None:
        """Write ``{output_dir}/step_{step}``: model files (a Hugging Face directory) and training state.

        Every rank gathers; rank 0 writes (staging, renamed when complete, then pruning: the
        :class:`CheckpointManager`). Weights with NaN or inf are never saved (:class:`NonFiniteError`).
        """
        # Never a checkpoint with NaN/inf weights: it could replace (keep_last_n_checkpoints) a finite one.
        if count_nonfinite_weights(self.model, self._dist.sum) > 0:
            raise NonFiniteError(advice(f"Not saving step {step}: weights hold NaN or inf"))
        model_state = self.gather_model_state()
        training_state = capture_training_state(
            step=self.global_step, epoch=self.prompts.epoch, seed=self.seed, model=self.model,
            optimizer=self.optimizer, lr_scheduler=self.step.update.lr_scheduler, dataloader=self.prompts.dataloader,
            generator=self._generator, device=self._device, is_rank_zero=self._is_rank_zero,
            gather_objects=self._dist.gather_objects, config=self._config_record,
            rollouts=self.step.rollouts.state_dict() if self.config.generation_workers.enabled else None,
        )
        if self._is_rank_zero:
            saved = self._checkpoints.write(step, model_state, training_state)
            log.info(f"Saved checkpoint for step {step} to {saved.directory} ({saved.seconds:.1f} s)")
            for old in saved.removed:
                log.info(f"Removed {old} (keep_last_n_checkpoints={self._checkpoints.keep_last_n})")
        dist.barrier()

    def cleanup(self) -> None:
        """Close loggers, the generation engine and the process group; release the output directory."""
        self.sigterm.restore()
        self._logs.close()
        if self.config.generation_workers.enabled:
            self.step.rollouts.close()
        self.engine.close()  # vLLM's teardown uses (and destroys) the process group: it goes first
        if dist.is_initialized():
            dist.destroy_process_group()
        self._output_lock.release()


def checkpoint_source(cfg: DictConfig) -> str:
    """Where the initial weights come from, for error messages: the checkpoint directory, or the
    checkpointer's component when it reads no directory (a benchmark's random weights)."""
    return str(cfg.checkpointer.get("checkpoint_dir", None) or cfg.checkpointer._component_)


def run_recipe(recipe_cls: type, cfg: DictConfig) -> None:
    """Set up, train and clean up ``recipe_cls`` (this recipe or a subclass such as the LoRA one)."""
    launched_by_torchrun = training.is_distributed()
    config.log_config(recipe_name=recipe_cls.__name__, cfg=cfg)
    recipe = recipe_cls(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()
    code = SIGTERM_EXIT_CODE if recipe.sigterm.stopped else 0  # saved and stopped on SIGTERM: 143
    if launched_by_torchrun:
        # gloo occasionally aborts in process teardown after all work is done ("terminate called
        # without an active exception"); everything is flushed and closed, so leave right away.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run grpo_full_finetune_distributed --config CONFIG [key=value ...]``."""
    run_recipe(GRPOFullFinetuneRecipeDistributed, cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())
