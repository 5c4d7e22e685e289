# torchtune-grpo: GRPO full fine-tuning on one or many processes (FSDP2).
#
#   tune run grpo_full_finetune_distributed --config configs/tiny/full_grpo_cpu.yaml
#   tune run --nproc_per_node 8 grpo_full_finetune_distributed --config my.yaml
#
# This file is installed as a top-level module, so `tune run` finds it from any directory.
"""GRPO (Group Relative Policy Optimization, Shao et al. 2024, arXiv:2402.03300), full fine-tuning.

One step, on every rank, and the object that carries it from one stage to the next::

    batch_size prompts -> group_size completions each, scored        RolloutGroups  (torchtune_grpo/rollout.py)
      [dynamic sampling: drop zero-variance groups, more rounds on new prompts until the batch is full]
      -> training layout, reference logprobs (frozen initial policy; none when kl_coef == 0) and old logprobs
      -> [KL penalty in the reward] -> advantages (group-relative, RLOO, batch std, ...)
                                                                     Experience     (torchtune_grpo/update.py)
      -> ppo_epochs x (micro-batched clipped loss + KL + entropy bonus, backward) -> clip grads -> step
      -> weight sync to an engine with its own weights (vLLM) -> metrics -> checkpoint

Global batch per step: ``batch_size x world_size`` prompts, ``x group_size`` sequences. Losses are
normalised by global token/sequence counts, so the update does not depend on how the batch is split over
micro-batches or processes. The variants (GRPO, Dr. GRPO, DAPO, GSPO) are config: see docs/algorithms.md
and the ``algorithm_card.md`` every run writes to its output directory. The class below reads in the order
of a step: setup, the step, then one section per stage (docs/architecture.md).
"""

import dataclasses
import math
import os
from itertools import chain
import shutil
import socket
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtune import config, modules, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm

from torchtune_grpo.algorithm_card import AlgorithmSpec, algorithm_card
from torchtune_grpo.assets import register_resolvers
from torchtune_grpo.checkpoint_manager import CheckpointManager, capture_training_state, restore_training_state
from torchtune_grpo.checkpointer_facts import epoch_output_dir
from torchtune_grpo.checkpointing import checkpoint_retention, model_files
from torchtune_grpo.crash_points import crash_point
from torchtune_grpo.config import build_multi_turn, instantiate_component, RecipeConfig
from torchtune_grpo.dynamic_sampling import DynamicSampling
from torchtune_grpo.experience import ExperienceBuilder, Reference
from torchtune_grpo.evaluation import correctness_name, evaluate, EvalSums
from torchtune_grpo.generation import check_engine, GenerationEngine, WeightPublisher, WeightSyncCheck
from torchtune_grpo.loss_masks import LossMasks
from torchtune_grpo.run_logs import JsonlWriter
from torchtune_grpo.models import drop_pad_input_embedding_grad
from torchtune_grpo.offpolicy import off_policy_note, RolloutCorrection
from torchtune_grpo.precision import Precision
from torchtune_grpo.producer import PromptStream, RolloutProducer
from torchtune_grpo.sharding import shard_model, unsharded
from torchtune_grpo.rewards import build_reward_set
from torchtune_grpo.multiturn import MultiTurn
from torchtune_grpo.nonfinite import advice, count_nonfinite, NonFiniteError
from torchtune_grpo.output_lock import OutputDirLock
from torchtune_grpo.preemption import SIGTERM_EXIT_CODE, StopOnSigterm
from torchtune_grpo.resume import config_changes, earlier_run_note, save_start_config
from torchtune_grpo.setup_checks import check_device, check_output_dir, check_state_dict_shapes, training_layout
from torchtune_grpo.metric_sums import Key, Reduce, reduce_over_ranks
from torchtune_grpo.step_metrics import sample_records, step_sums, train_step_metrics
from torchtune_grpo.token_selection import HighEntropyTokens
from torchtune_grpo.update import PolicyUpdate

log = utils.get_logger("INFO")
register_resolvers()  # ${grpo_asset:...} in shipped configs

_PROFILER_OFF = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False}


def _init_distributed(device_type: str) -> None:
    # `tune run` without --nproc_per_node runs us in-process: make a one-process group so the collectives
    # and state-dict gathering are the same on 1 process as on 64 (FSDP2 there only with fsdp_single_process).
    if not training.is_distributed():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(training.get_distributed_backend(device_type))



class GRPOFullFinetuneRecipeDistributed(FTRecipeInterface):
    """GRPO full fine-tuning, FSDP2-sharded across processes. See the module docstring and ``docs/``.

    Args:
        cfg (DictConfig): the run's config (see ``configs/tiny/full_grpo_cpu.yaml`` for every key).
    """

    # What the KL term is measured against (printed on the algorithm card).
    REFERENCE_DESCRIPTION = "loaded (frozen copy of the initial policy)"

    # Every key this recipe reads, with its default and range (torchtune_grpo/config_schema.py; the LoRA
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
        self._engine: GenerationEngine = self._check_engine(check_engine(config.instantiate(cfg.generation)), cfg)
        if not float(self._engine.temperature) > 0:  # a custom engine's default; the config's is checked
            raise ValueError(
                f"generation.temperature must be > 0 for training, got {self._engine.temperature} "
                f"({type(self._engine).__name__}'s): greedy groups hold G copies of one completion."
            )
        check_device(c.device)  # torchtune's get_device falls back to the CPU without a word
        self._device = utils.get_device(device=c.device)
        # dtype: fp32 | bf16 (fp32 master weights, bf16 compute) | bf16_pure (torchtune_grpo/precision.py)
        self._precision = Precision.from_name(c.dtype)
        self._dtype = self._precision.compute_dtype  # frozen models (the reference; LoRA's models)
        _init_distributed(self._device.type)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0

        self.output_dir = c.output_dir
        self.group_size = c.group_size
        self.batch_size = c.batch_size
        self.max_response_length = c.max_response_length
        self.ppo_epochs = c.ppo_epochs
        # optimizer steps per pass over a step's rollouts, each on a disjoint mini-batch of whole groups
        self.ppo_mini_batches = c.ppo_mini_batches
        self.ppo_mini_batch_shuffle = c.ppo_mini_batch_shuffle
        self.micro_batch_size = c.micro_batch_size
        self.kl_coef = c.kl_coef
        self.kl_estimator = c.kl_estimator
        # "reward": penalise each sequence's reward before the advantage (RLHF-PPO); "loss": GRPO's term.
        self.kl_in_reward = self.kl_coef > 0 and c.kl_placement == "reward"
        self.mask_truncated = c.mask_truncated_completions
        # Training forwards compute each prompt once for its group's sequences (torchtune_grpo/training_batch.py).
        self.share_prompt = c.share_prompt_in_training
        self._dynamic = DynamicSampling(**dataclasses.asdict(c.dynamic_sampling))
        self.clip_grad_norm = c.clip_grad_norm
        self.logprob_chunk_size = c.logprob_chunk_size
        self.save_every_n_steps = c.save_every_n_steps
        self.keep_last_n_checkpoints = checkpoint_retention(c.keep_last_n_checkpoints)
        self.log_every_n_steps = c.log_every_n_steps
        self.log_completions = c.log_completions
        self.resume_from_checkpoint = c.resume_from_checkpoint
        # Faults (docs/recipe.md, "What survives what"; torchtune_grpo/nonfinite.py, resume.py, preemption.py)
        self.on_nonfinite = c.on_nonfinite
        self.on_broken_checkpoint = c.on_broken_checkpoint
        self.sigterm = StopOnSigterm(c.save_on_sigterm)
        self._output_lock = OutputDirLock(self.output_dir)
        # step_N directories: when to save, writing, pruning, resuming (torchtune_grpo/checkpoint_manager.py)
        self._checkpoints = CheckpointManager(
            self.output_dir, self._write_model_files, save_every_n_steps=self.save_every_n_steps,
            keep_last_n=self.keep_last_n_checkpoints, on_broken=self.on_broken_checkpoint,
            discard_partial=lambda step: shutil.rmtree(epoch_output_dir(self._checkpointer, step), ignore_errors=True),
        )
        # Saved in every checkpoint: a resume lists the settings changed since.
        self._config_record = OmegaConf.to_container(cfg, resolve=True)
        self._reshard_after_forward = c.fsdp_reshard_after_forward
        self.seed = training.set_seed(seed=c.seed)
        self.global_step = 0
        # Held-out evaluation: at step 0, every eval_every_n_steps and at the end (when `validation` is set).
        self.eval_every_n_steps = c.eval_every_n_steps
        self.eval_num_samples = c.eval_num_samples
        self.eval_pass_k = c.eval_pass_k
        self.eval_max_prompts = c.eval_max_prompts
        self.eval_threshold = c.eval_threshold
        self.eval_batch_size = c.eval_batch_size
        self._validation = None

    # ================================================================================================ setup

    def _check_engine(self, engine: GenerationEngine, cfg: DictConfig) -> GenerationEngine:
        """The generation engine, if this recipe can train with it (a hook: LoRA refuses some)."""
        return engine

    def setup(self, cfg: DictConfig) -> None:
        """Build everything from the config and, when resuming, restore the latest checkpoint.

        Everything that can fail on the config alone (output directory, resume checkpoint, rewards vs
        ``eval_reward``, loss arguments) fails before a model is built.
        """
        if self._is_rank_zero:
            check_output_dir(self.output_dir)
            self._output_lock.acquire()  # one run per output_dir; raises naming the run that holds it
            for line in self._checkpoints.recover():  # what killed saves left (a save the disk filled up)
                log.info(f"Checkpoints: {line}")
        dist.barrier()
        resume = None
        if self.resume_from_checkpoint:  # every rank reads the same checkpoint; rank 0 cuts the logs back
            resume, done = self._checkpoints.resume_point(cut_logs=self._is_rank_zero)
            for note in resume.notes if self._is_rank_zero else []:
                log.warning(f"Checkpoints: {note}")
            for line in done:
                log.info(line)
        if resume is None and self._is_rank_zero and (note := earlier_run_note(self.output_dir)):
            log.warning(note)
        resume_dir = resume.directory if resume is not None else None
        if self._is_rank_zero:
            path = save_start_config(self.output_dir, self._config_record, resume.step if resume else None)
            log.info(f"This start's config: {path}")
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)
            self._metrics_file = JsonlWriter(os.path.join(self.output_dir, "metrics.jsonl"))
            self._completions_file = JsonlWriter(os.path.join(self.output_dir, "completions.jsonl"))

        self._rewards = build_reward_set(
            cfg.reward_functions, fallback=self.config.reward_fallback
        )
        self._check_evaluation_keys(cfg)
        self._advantage = instantiate_component(cfg, "advantage")
        self._loss_fn = instantiate_component(
            cfg, "loss",
            kl_coef=0.0 if self.kl_in_reward else self.kl_coef,
            kl_estimator=self.kl_estimator,
            max_response_length=self.max_response_length,
        )
        # Masks and weights decided from pi_old before the update (torchtune_grpo/loss_masks.py).
        rc_cfg, ts_cfg = self.config.rollout_correction, self.config.token_selection
        self._loss_masks = LossMasks(
            RolloutCorrection(**rc_cfg) if rc_cfg is not None else None,
            HighEntropyTokens(**ts_cfg) if ts_cfg is not None else None,
        )
        note = off_policy_note(
            getattr(self._loss_fn, "tis_cap", None), type(self._engine).__name__, self._engine.holds_weights
        )
        if note and rc_cfg is None:  # rollout_correction is the other answer to the mismatch
            utils.log_rank_zero(log, note)
        base_checkpointer = config.instantiate(cfg.checkpointer)
        recipe_state = None
        if resume is not None:
            utils.log_rank_zero(log, f"Resuming from {resume_dir}")
            recipe_state = resume.state
            changed = config_changes(recipe_state.get("config"), self._config_record)
            if changed:
                utils.log_rank_zero(
                    log, f"Settings changed since {resume_dir.name} was saved (the run continues with the new "
                    f"ones): {'; '.join(changed)}"
                )
            # The seed decides the data order: restore it before the sampler is built.
            if recipe_state["seed"] != self.seed:
                utils.log_rank_zero(
                    log, f"Using the checkpoint's seed {recipe_state['seed']}, not {self.seed}"
                )
                self.seed = training.set_seed(seed=recipe_state["seed"])
        self._setup_models(cfg, base_checkpointer, resume_dir)
        self.share_prompt, note = training_layout(  # prompts shared in training forwards (training_batch.py)
            self._model, share_prompt=self.share_prompt, explicit="share_prompt_in_training" in cfg,
            max_prompt_length=self.config.max_prompt_length, max_response_length=self.max_response_length,
            group_size=self.group_size, micro_batch_size=self.micro_batch_size,
        )
        if note:
            utils.log_rank_zero(log, note)

        self._tokenizer = config.instantiate(cfg.tokenizer)
        if self.config.drop_pad_embedding_grad:  # TRL's behaviour (docs/algorithms.md)
            drop_pad_input_embedding_grad(self._model, self._tokenizer.pad_id)
            utils.log_rank_zero(
                log, f"drop_pad_embedding_grad: the pad token's (id {self._tokenizer.pad_id}) input embedding "
                "gets no gradient where it is an input, as transformers' padding_idx"
            )
        # Multi-turn episodes (docs/multi_turn.md): set before the datasets tokenize their prompts, which
        # then list the environment's tools.
        self._multi_turn = self._setup_multi_turn(cfg)
        self._optimizer = instantiate_component(cfg, "optimizer", self._model.parameters())
        # This rank's prompts across epochs (torchtune_grpo/producer.py).
        dataset = config.instantiate(cfg.dataset, self._tokenizer)
        self.prompts = PromptStream.over(
            dataset, batch_size=self.batch_size, world_size=self.world_size, rank=self.rank,
            shuffle=self.config.shuffle, seed=self.seed,
        )
        utils.log_rank_zero(
            log, f"{len(dataset)} prompts; global batch per step = batch_size {self.batch_size} x "
            f"{self.world_size} rank(s) x group_size {self.group_size} = "
            f"{self.batch_size * self.world_size * self.group_size} sequences",
        )
        # An engine with its own copy of the weights (vLLM) gets the trainer's after every optimizer step,
        # and a check that it really has them (docs/vllm.md). The native engine samples with self._model.
        self._publisher = None
        if self._engine.holds_weights:
            ws_cfg = self.config.weight_sync
            self._publisher = WeightPublisher(
                self._engine, config.instantiate(ws_cfg) if ws_cfg is not None else WeightSyncCheck(),
                probe_prompt=dataset[0]["tokens"],  # the same on every rank and every check
                device=self._device, all_reduce_max=lambda x: self._all_reduce([x], Reduce.MAX)[0],
                chunk_size=self.logprob_chunk_size,
                trainer_dtype=self._precision.compute_dtype,  # the engine's dtype follows it unless set
            )
        self._setup_validation(cfg)

        self.epochs = self.config.epochs
        self.steps_per_epoch = len(self.prompts)
        max_steps = self.config.max_steps
        self.total_steps = (
            int(max_steps) if max_steps is not None else self.epochs * self.steps_per_epoch
        )
        self._lr_scheduler = None
        if self.config.lr_scheduler is not None:
            self._lr_scheduler = instantiate_component(
                cfg, "lr_scheduler",
                self._optimizer,
                # the schedule counts optimizer steps: ppo_epochs x ppo_mini_batches per training step
                num_training_steps=self.total_steps * self.ppo_epochs * self.ppo_mini_batches,
                last_epoch=-1,
            )
        # The update core (torchtune_grpo/update.py): micro-batched loss with global normalisation,
        # FSDP2 gradient sync, clipping, optimizer and scheduler steps.
        self._update = PolicyUpdate(
            self._model,
            self._optimizer,
            self._loss_fn,
            lr_scheduler=self._lr_scheduler,
            ppo_epochs=self.ppo_epochs,
            ppo_mini_batches=self.ppo_mini_batches,
            group_size=self.group_size,
            seed=self.seed,
            shuffle=self.ppo_mini_batch_shuffle,
            micro_batch_size=self.micro_batch_size,
            clip_grad_norm=self.clip_grad_norm,
            world_size=self.world_size,
            all_reduce=self._all_reduce_sum,  # each mini-batch's global token/sequence counts
            temperature=self._logprob_temperature,
            chunk_size=self.logprob_chunk_size,
            on_nonfinite=self.on_nonfinite,
        )
        # Selected rollouts -> the update's input (torchtune_grpo/experience.py).
        self.build_experience = ExperienceBuilder(
            advantage=self._advantage, reward_weights=self._rewards.weights, group_size=self.group_size,
            pad_id=self._tokenizer.pad_id, loss_masks=self._loss_masks, micro_batch_size=self.micro_batch_size,
            temperature=self._logprob_temperature, device=self._device, chunk_size=self.logprob_chunk_size,
            share_prompt=self.share_prompt, mask_truncated=self.mask_truncated, kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator, kl_in_reward=self.kl_in_reward, reference=self._reference(),
            update_needs_old_logprobs=self._update.needs_old_logprobs,
            all_reduce=self._all_reduce_sum, all_gather=self._all_gather_cat,
        )
        # One generator per rank, so ranks draw different samples for their different prompts.
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(self.seed + self.rank)
        # The step's scored rollouts (torchtune_grpo/producer.py).
        self.rollouts = RolloutProducer(
            engine=self._engine, tokenizer=self._tokenizer, rewards=self._rewards, prompts=self.prompts,
            group_size=self.group_size, batch_size=self.batch_size, max_new_tokens=self.max_response_length,
            generator=self._generator, dynamic=self._dynamic, multi_turn=self._multi_turn,
            generation_context=self._generation_context, all_reduce_sum=self._all_reduce_sum,
        )

        if recipe_state is not None:
            self.global_step, self.prompts.epoch = recipe_state["step"], recipe_state["epoch"]
            restored_rng = restore_training_state(
                recipe_state, model=self._model, optimizer=self._optimizer, lr_scheduler=self._lr_scheduler,
                dataloader=self.prompts.dataloader, generator=self._generator, device=self._device, rank=self.rank,
                world_size=self.world_size,
            )
            if not restored_rng:
                utils.log_rank_zero(log, "World size changed since the checkpoint: RNG streams restart.")
        profiler_cfg = self.config.profiler or OmegaConf.create(_PROFILER_OFF)
        self._profiler, _ = config.instantiate(profiler_cfg)
        self._write_algorithm_card(cfg)
        if self._publisher is not None:
            # The engine started from checkpoint_dir; a resumed or converted policy may differ from it.
            sync = self._publisher.publish(self._model, step=self.global_step)
            utils.log_rank_zero(log, f"Generation engine started, weights synced and checked: {sync}")

    def _write_algorithm_card(self, cfg: DictConfig) -> None:
        """Print and write ``${output_dir}/algorithm_card.md``: what this run optimises, exactly."""
        spec = AlgorithmSpec.from_components(
            loss=self._loss_fn,
            advantage=self._advantage,
            rewards=self._rewards,
            optimizer=self._optimizer,
            lr_schedule=cfg.lr_scheduler._component_ if self._lr_scheduler is not None else None,
            world_size=self.world_size,
            batch_size=self.batch_size,
            group_size=self.group_size,
            micro_batch_size=self.micro_batch_size,
            ppo_epochs=self.ppo_epochs,
            ppo_mini_batches=self.ppo_mini_batches,
            ppo_mini_batch_shuffle=self.ppo_mini_batch_shuffle,
            precision=self._precision.describe(),
            max_response_length=self.max_response_length,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            kl_placement="reward" if self.kl_in_reward else "loss",
            reference_model=self.build_experience.reference is not None,
            reference_description=self.REFERENCE_DESCRIPTION,
            mask_truncated_completions=self.mask_truncated,
            dynamic_sampling=self._dynamic.enabled,
            max_rounds=self._dynamic.max_rounds,
            clip_grad_norm=None if self.clip_grad_norm is None else float(self.clip_grad_norm),
            on_nonfinite=self.on_nonfinite,
            environment=None if self._multi_turn is None else (
                f"{type(self._multi_turn.environment).__name__}, at most {self._multi_turn.max_turns} turns"
            ),
            weight_sync=self._publisher.describe(self._model) if self._publisher is not None else None,
            **self._loss_masks.formula_lines(),
        )
        if self._is_rank_zero:
            card = algorithm_card(spec)
            os.makedirs(self.output_dir, exist_ok=True)
            with open(os.path.join(self.output_dir, "algorithm_card.md"), "w", encoding="utf-8") as f:
                f.write(card)
            log.info("Algorithm card (also in %s/algorithm_card.md):\n%s", self.output_dir, card)

    def _setup_models(self, cfg: DictConfig, base_checkpointer: Any, resume_dir: Optional[Any]) -> None:
        """Build the policy (``self._model``), the reference (``self._ref_model``) and ``self._checkpointer``.

        A hook: the LoRA recipe overrides it (base weights + adapters, no second model).
        """
        if resume_dir is None:
            self._checkpointer = base_checkpointer
        else:
            self._checkpointer = config.instantiate(
                cfg.checkpointer, checkpoint_dir=str(resume_dir), checkpoint_files=model_files(resume_dir)
            )
        policy_state = self._checkpointer.load_checkpoint()[training.MODEL_KEY]
        source = str(resume_dir) if resume_dir is not None else checkpoint_source(cfg)
        self._model = self._setup_model(cfg, policy_state, trainable=True, source=source)
        # The reference is the *initial* policy, also after a resume. With kl_coef == 0 it is never
        # used: don't spend its memory.
        self._ref_model = None
        if self.kl_coef > 0:
            ref_state = (
                policy_state if resume_dir is None
                else base_checkpointer.load_checkpoint()[training.MODEL_KEY]
            )
            self._ref_model = self._setup_model(
                cfg, ref_state, trainable=False, source=checkpoint_source(cfg)
            )
            del ref_state
        del policy_state
        utils.log_rank_zero(
            log,
            f"Reference model: {'frozen copy of the initial policy' if self._ref_model else 'none (kl_coef = 0)'}",
        )

    def _setup_model(
        self, cfg: DictConfig, state_dict: Dict[str, Any], trainable: bool, source: str
    ) -> torch.nn.Module:
        """The model of ``cfg.model`` with ``state_dict`` (read from the directory ``source``) loaded."""
        # The trained policy keeps its weights in the precision's param dtype (fp32 master weights with bf16).
        mixed = trainable and self._precision.mixed
        param_dtype = self._precision.param_dtype if trainable else self._dtype
        with training.set_default_dtype(param_dtype), torch.device("meta"):
            model = config.instantiate(cfg.model)
        self._check_max_seq_len(cfg, model)
        check_state_dict_shapes(chain(model.named_parameters(), model.named_buffers()), state_dict, source)
        if trainable and self.config.enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        cpu_offload = self.config.fsdp_cpu_offload
        # One process trains the plain module unless fsdp_single_process (or fsdp_cpu_offload) asks for FSDP2:
        # there it has nothing to shard and only copies weights and gradients (docs/configs.md).
        # Mixed precision is FSDP2's MixedPrecisionPolicy, on one process too (the same casts as on N).
        shard = self.world_size > 1 or cpu_offload or self.config.fsdp_single_process or mixed
        if trainable and self.world_size == 1:
            why = "fsdp_cpu_offload: true" if cpu_offload else "fsdp_single_process: true"
            why = f"dtype: {self._precision.name}, mixed precision" if mixed else why
            plain = "the plain model (fsdp_single_process: false)"
            mode = f"the FSDP2-wrapped model ({why})" if shard else plain
            utils.log_rank_zero(log, f"One process: training {mode}")
        if shard:
            self._shard(model, cpu_offload=cpu_offload, mixed_precision=mixed)
        else:
            model.to_empty(device=self._device)
        self._init_rope(model)
        if shard:
            training.load_from_full_model_state_dict(
                model, state_dict, self._device, strict=True, cpu_offload=cpu_offload
            )
        else:
            model.load_state_dict(state_dict, strict=True)
        training.validate_no_params_on_meta_device(model)
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        return model

    def _check_max_seq_len(self, cfg: DictConfig, model: torch.nn.Module) -> None:
        """Fail when prompt + response budget exceeds the model's ``max_seq_len`` (RoPE cache size)."""
        max_len = (self.config.max_prompt_length or 0) + self.max_response_length
        if getattr(model, "max_seq_len", None) is not None and max_len > model.max_seq_len:
            raise ValueError(
                f"max_prompt_length + max_response_length = {max_len} exceeds the model's "
                f"max_seq_len = {model.max_seq_len}"
            )

    def _check_evaluation_keys(self, cfg: DictConfig) -> None:
        """Fail on an ``eval_reward`` that names no reward; say when eval keys go unused (no validation)."""
        if self.config.validation is not None:
            correctness_name(self._rewards.names, self.config.eval_reward)
            return
        unused = sorted(k for k in cfg if k.startswith("eval_") and cfg[k] is not None)
        if unused:
            utils.log_rank_zero(log, f"No held-out evaluation (validation is not set): {unused} are not used.")

    def _shard(self, model: torch.nn.Module, *, cpu_offload: bool, mixed_precision: bool = False) -> None:
        """FSDP2 per transformer layer, then the root (a hook: LoRA keeps NF4 weights out).

        ``mixed_precision``: layers compute in bf16 from the fp32 master weights (torchtune_grpo/precision.py).
        """
        shard_model(
            model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
            cpu_offload=cpu_offload,
            reshard_after_forward=self._reshard_after_forward,
            precision=self._precision if mixed_precision else None,
        )

    def _init_rope(self, model: torch.nn.Module) -> None:
        """Fill the RoPE caches: buffers that meta-device init left empty (in the weights' dtype)."""
        with training.set_default_dtype(next(model.parameters()).dtype), self._device:
            for m in model.modules():
                if hasattr(m, "rope_init"):
                    m.rope_init()

    def _setup_multi_turn(self, cfg: DictConfig) -> Optional[MultiTurn]:
        """The environment and episode limits (``environment``, ``multi_turn``), or None for single turns."""
        multi_turn = build_multi_turn(self.config)
        if multi_turn is None:
            return None
        note = multi_turn.attach(self._tokenizer)  # fails now if the chat template cannot be continued
        if note:
            utils.log_rank_zero(log, note)
        turns = multi_turn.turns_for(self._tokenizer)
        utils.log_rank_zero(
            log,
            f"Multi-turn episodes: {type(multi_turn.environment).__name__}, at most {multi_turn.max_turns} turns, "
            f"replies rendered by {type(turns).__name__}",
        )
        return multi_turn

    def _setup_validation(self, cfg: DictConfig) -> None:
        """Held-out prompts of this rank (every world_size-th, so ranks share the work), or None."""
        if self.config.validation is None:
            return
        dataset = config.instantiate(cfg.validation, self._tokenizer)
        n = len(dataset)
        if self.eval_max_prompts is not None:
            n = min(n, int(self.eval_max_prompts))
        self._validation = [dataset[i] for i in range(self.rank, n, self.world_size)]
        self._eval_reward = self.config.eval_reward
        utils.log_rank_zero(log, f"Held-out evaluation on {n} validation prompts")

    # ============================================================================================= the step

    def train(self) -> None:
        """Run GRPO steps until ``max_steps`` (or ``epochs`` x batches per epoch), or until SIGTERM.

        On SIGTERM (``save_on_sigterm``) the current step is finished, a checkpoint saved and the loop left;
        ``self.sigterm.stopped`` then says so (``run_recipe`` exits with 143).
        """
        self.sigterm.install()
        if self._device.type == "cuda":
            training.cleanup_before_training()  # empty_cache; torch.cpu has none
        self._optimizer.zero_grad(set_to_none=True)
        pbar = tqdm(
            total=self.total_steps, initial=self.global_step, disable=not self._is_rank_zero,
            desc="GRPO", dynamic_ncols=True,
        )
        self._profiler.start()
        if self._validation is not None:
            self._log_eval()  # step 0 (or the resumed step): the baseline
        # max_steps (when set) wins over epochs; the data then cycles for as many epochs as needed.
        while self.global_step < self.total_steps:
            metrics, samples = self._train_step(self.prompts.next())
            self.global_step += 1
            pbar.update(1)
            pbar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.4f}")
            if self._is_rank_zero:
                self._metrics_file.write({"step": self.global_step, **metrics})
                self._completions_file.write_many(samples)
                if self.global_step % self.log_every_n_steps == 0:
                    self._metric_logger.log_dict(metrics, step=self.global_step)
            crash_point("logged", self.global_step)  # test-only (torchtune_grpo/crash_points.py)
            self._profiler.step()
            if self.sigterm.agreed(self._all_reduce_sum):  # any rank got SIGTERM: all save this step, stop
                utils.log_rank_zero(log, f"Stopping on SIGTERM after step {self.global_step}: saving a checkpoint")
                self.save_checkpoint(self.global_step)
                self.sigterm.stopped = True
                break
            if self._checkpoints.is_due(self.global_step, self.total_steps):
                self.save_checkpoint(self.global_step)
            if (
                self._validation is not None
                and self.eval_every_n_steps
                and self.global_step < self.total_steps
                and self.global_step % int(self.eval_every_n_steps) == 0
            ):
                self._log_eval()
        self._profiler.stop()
        pbar.close()
        if self.sigterm.stopped:
            return
        if self._validation is not None:
            self._log_eval()  # the end
        self.save_checkpoint(self.global_step)

    def _train_step(self, batch) -> "tuple[Dict[str, Any], List[Dict[str, Any]]]":
        """One GRPO step on this rank's prompt ``batch``: the metrics (global) and ``completions.jsonl`` rows."""
        t0 = time.perf_counter()
        generated, num_rounds = self.rollouts.collect(self._model, batch)  # rollout and rewards
        crash_point("rollout", self.global_step + 1)
        selection = self._dynamic.select(generated, self.batch_size)
        trained = generated.select(selection.indices)
        # Layout, reference/old logprobs, advantages, masks: everything the update takes.
        exp, kl_penalty = self.build_experience(self._model, trained)
        stats = self._update(exp, step=self.global_step)
        crash_point("update", self.global_step + 1)
        # The engine (vLLM) samples the next step from the weights just updated.
        sync = self._publisher.publish(self._model, step=self.global_step + 1) if self._publisher else None
        t_step = time.perf_counter() - t0

        # Metrics: this rank's quantities, reduced over ranks by key, then the declared metrics
        # (torchtune_grpo/step_metrics.py, metric_sums.py).
        zero_std = self._dynamic.informative(generated).logical_not()
        local = step_sums(generated, zero_std, selection, stats.losses, kl_penalty, len(exp), exp.metric_sums)
        local.add(("nonfinite_weights",), count_nonfinite(self._trained_parameters()))  # this rank's shards
        reduced = reduce_over_ranks(local, self._all_reduce)
        self._check_finite(reduced, stats.skipped_steps)
        metrics = train_step_metrics(
            reduced,
            rounds=num_rounds,  # the same on every rank
            lr=get_lr(self._optimizer),
            step_seconds=t_step,
            rollout=generated,
            weight_sync=sync,
            grad_norm=stats.grad_norm,
            peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if self._device.type == "cuda" else None,
        )
        metrics["nonfinite/skipped_optimizer_steps"] = stats.skipped_steps
        samples = sample_records(trained, exp.advantages, self.global_step + 1, self.log_completions)
        return metrics, samples

    def _trained_parameters(self) -> List[torch.Tensor]:
        """The parameters the optimizer changes (frozen ones, NF4 included, cannot turn non-finite)."""
        return [p for p in self._model.parameters() if p.requires_grad]

    def _check_finite(self, reduced: Dict[Key, float], skipped_steps: int) -> None:
        """Stop on non-finite weights (always) or loss (``on_nonfinite: stop``); warn on skipped steps.

        ``reduced`` is global, so every rank raises at the same step (torchtune_grpo/nonfinite.py).
        """
        step = self.global_step + 1
        if (broken := reduced[("nonfinite_weights",)]) > 0:
            raise NonFiniteError(advice(f"{int(broken)} weight tensor(s) hold NaN or inf after training step {step}"))
        loss = reduced[("update", "loss")]
        if not math.isfinite(loss):
            if self.on_nonfinite == "stop":
                raise NonFiniteError(advice(f"The loss is {loss} at training step {step}"))
            if self._is_rank_zero:
                log.warning(f"Step {step}: the loss is {loss} (on_nonfinite=skip)")
        if skipped_steps:
            utils.log_rank_zero(
                log, f"Step {step}: {skipped_steps} optimizer step(s) skipped, non-finite gradient norm "
                "(on_nonfinite=skip; metric nonfinite/skipped_optimizer_steps)"
            )

    # ========================================================================================== rollout

    def _generation_context(self) -> ContextManager:
        """Around each generation call: the policy's parameters gathered once per rollout rather than once per
        decoded token; nothing for an engine with its own copy of the weights."""
        return nullcontext() if self._engine.holds_weights else unsharded(self._model, self._reshard_after_forward)

    def _reference(self) -> Optional[Reference]:
        """What the KL term is measured against: the frozen initial policy, or None without a KL term (a
        hook: the LoRA recipe's reference is the policy with its adapters switched off)."""
        return Reference(self._ref_model) if self._ref_model is not None else None

    @property
    def _logprob_temperature(self) -> float:
        # Logprobs are those of the distribution sampled from (temperature-scaled), as in the ratio. It is
        # > 0: checked when the recipe starts.
        return float(self._engine.temperature)

    # =========================================================================== metrics and evaluation

    def _all_reduce(self, values: List[float], op: Reduce = Reduce.SUM) -> List[float]:
        """``values`` reduced elementwise over ranks (float64): summed, or the maximum."""
        t = torch.tensor(values, dtype=torch.float64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op is Reduce.MAX else dist.ReduceOp.SUM)
        return t.tolist()

    def _all_reduce_sum(self, values: List[float]) -> List[float]:
        return self._all_reduce(values, Reduce.SUM)

    def _all_gather_objects(self, value: Any) -> List[Any]:
        """Every rank's ``value``, in rank order (pickled: small objects only)."""
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def _all_gather_cat(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D CPU tensor, concatenated in rank order (token selection's global threshold)."""
        return torch.cat(self._all_gather_objects(values))

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Held-out metrics ``eval/*`` (greedy accuracy, mean reward, pass@k), the same on every rank."""
        t0 = time.perf_counter()
        # Its own RNG stream: evaluating does not change the training samples drawn afterwards.
        generator = torch.Generator(device=self._device)
        generator.manual_seed(self.seed + 7919 * (self.rank + 1))
        self._model.eval()
        with self._generation_context():
            sums = evaluate(
                self._model,
                self._tokenizer,
                self._engine,
                self._validation,
                self._rewards,
                max_new_tokens=self.max_response_length,
                num_samples=self.eval_num_samples,
                k=self.eval_pass_k,
                correctness=self._eval_reward,
                threshold=self.eval_threshold,
                batch_size=self.eval_batch_size,
                multi_turn=self._multi_turn,
                generator=generator,
            )
        self._model.train()
        reduced = EvalSums.from_list(self._all_reduce_sum(sums.as_list()), k=sums.k, multi_turn=sums.multi_turn)
        metrics = reduced.metrics()
        metrics["time/eval"] = time.perf_counter() - t0
        return metrics

    def _log_eval(self) -> None:
        metrics = self.evaluate()
        if self._is_rank_zero:
            self._metrics_file.write({"step": self.global_step, **metrics})
            self._metric_logger.log_dict(metrics, step=self.global_step)
            shown = ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "eval/num_prompts")
            log.info(f"Held-out evaluation at step {self.global_step}: {shown}")

    # ====================================================================================== checkpoints

    def save_checkpoint(self, step: int) -> None:
        """Write ``{output_dir}/step_{step}``: model files (a Hugging Face directory) and training state.

        Every rank gathers; rank 0 writes (staging, renamed when complete, then pruning: the
        :class:`CheckpointManager`). Weights with NaN or inf are never saved (:class:`NonFiniteError`).
        """
        # Never a checkpoint with NaN/inf weights: it could replace (keep_last_n_checkpoints) a finite one.
        if self._all_reduce_sum([float(count_nonfinite(self._trained_parameters()))])[0] > 0:
            raise NonFiniteError(advice(f"Not saving step {step}: weights hold NaN or inf"))
        model_state = self._gather_model_state()
        training_state = capture_training_state(
            step=self.global_step, epoch=self.prompts.epoch, seed=self.seed, model=self._model,
            optimizer=self._optimizer, lr_scheduler=self._lr_scheduler, dataloader=self.prompts.dataloader,
            generator=self._generator, device=self._device, is_rank_zero=self._is_rank_zero,
            gather_objects=self._all_gather_objects, config=self._config_record,
        )
        if self._is_rank_zero:
            saved = self._checkpoints.write(step, model_state, training_state)
            log.info(f"Saved checkpoint for step {step} to {saved.directory} ({saved.seconds:.1f} s)")
            for old in saved.removed:
                log.info(f"Removed {old} (keep_last_n_checkpoints={self.keep_last_n_checkpoints})")
        dist.barrier()

    def _gather_model_state(self) -> Dict[str, Any]:
        """The full model state dict on rank 0's CPU (other ranks: empty); a hook (LoRA: maybe adapters only)."""
        return training.gather_cpu_state_dict(self._model, self._is_rank_zero, device=self._device)

    def _write_model_files(self, model_state: Dict[str, Any], staging: Path, step: int) -> None:
        """Write the checkpoint's model files as the directory ``staging`` (a hook: LoRA adds its adapter)."""
        written = epoch_output_dir(self._checkpointer, step)
        shutil.rmtree(written, ignore_errors=True)  # left by a killed save
        self._checkpointer.save_checkpoint(
            {training.MODEL_KEY: model_state}, epoch=step, intermediate_checkpoint=False
        )
        os.replace(written, staging)

    def cleanup(self) -> None:
        """Close loggers, the generation engine and the process group; release the output directory."""
        self.sigterm.restore()
        if self._is_rank_zero:
            self._metric_logger.close()
            self._metrics_file.close()
            self._completions_file.close()
        self._engine.close()  # vLLM's teardown uses (and destroys) the process group: it goes first
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
