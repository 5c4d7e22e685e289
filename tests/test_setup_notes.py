"""No silent fallbacks: where a run takes another path than the config suggests, setup says so once (or
refuses when the config asked for the path explicitly)."""

import logging
import sys

import pytest
from omegaconf import OmegaConf
from torch import nn

from tests.conftest import make_tiny_decoder
from tests.recipe_utils import recipe_in_process, write_config
from torchtune_grpo.generation import check_engine, VLLMGenerator
from torchtune_grpo.loss.rollout_correction import off_policy_note
from torchtune_grpo.rewards import MathAnswerReward


def test_recipe_setup_logs_each_fallback_once(tmp_path, clean_env, one_thread, caplog):

    # max_seq_len 160 fits one sequence (max_prompt_length 128 + max_response_length 24 = 152) but not a
    # shared-prompt row: 128 + min(group_size 4, micro_batch_size 8) x (24 - 1) = 220 slots.
    cfg = OmegaConf.load(write_config(
        tmp_path, max_steps=1, **{"model.max_seq_len": 160, "loss.tis_cap": 2.0, "eval_batch_size": 8}
    ))
    assert "share_prompt_in_training" not in cfg  # on by default
    with caplog.at_level(logging.INFO), recipe_in_process(cfg):
        notes = {
            "layout": "Training layout: a micro-batch whose shared-prompt row (prompt + 4 completions; longest "
                      "220) exceeds the model's max_seq_len 160 is computed one row per sequence",
            "tis": "Off-policy correction: loss.tis_cap=2 has no effect: NativeGenerator samples with the "
                   "trainer's own model",
            "eval": "No held-out evaluation (validation is not set): ['eval_batch_size'] are not used.",
        }
        for what, text in notes.items():
            assert caplog.text.count(text) == 1, what


def test_a_model_that_cannot_share_prompts_falls_back_unless_asked_for():
    # The default falls back (with a note); a share_prompt_in_training written in the config fails.
    from torchtune_grpo.training.batch import training_layout

    args = dict(share_prompt=True, max_prompt_length=128, max_response_length=24, group_size=4, micro_batch_size=8)
    shared, note = training_layout(nn.Linear(2, 2), explicit=False, **args)
    assert shared is False and note.startswith(
        "Training layout: one row per sequence, because the model is a Linear, not a torchtune "
        "TransformerDecoder (share_prompt_in_training is on by default"
    )
    with pytest.raises(ValueError, match="share_prompt_in_training: true, but the model is a Linear, not a "
                                         "torchtune TransformerDecoder. Set share_prompt_in_training: false."):
        training_layout(nn.Linear(2, 2), explicit=True, **args)
    assert training_layout(nn.Linear(2, 2), explicit=True, **{**args, "share_prompt": False}) == (False, None)
    # Packed rows are for one row per sequence: used where prompts cannot be shared, said not used where they are.
    assert training_layout(nn.Linear(2, 2), explicit=False, pack=True, **args)[0] is False
    shared, note = training_layout(make_tiny_decoder(), explicit=False, pack=True, **args)
    assert shared is True and note == (
        "pack_sequences_in_training: not used, prompts are shared (share_prompt_in_training); packed rows are for "
        "one row per sequence."
    )


def test_off_policy_note_for_an_engine_with_its_own_logprobs():
    assert off_policy_note(None, "VLLMGenerator", True) == (
        "Off-policy correction: none. VLLMGenerator samples with its own kernels, but the loss has no tis_cap, "
        "so its sampling logprobs only feed generation/logprob_mismatch. Set loss.tis_cap (e.g. 2.0) for "
        "truncated importance sampling."
    )
    assert off_policy_note(2.0, "VLLMGenerator", True) is None  # TIS on, as asked
    assert off_policy_note(None, "NativeGenerator", False) is None  # nothing to correct


def test_vllm_engine_without_vllm_fails_when_checked(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib finds no vllm
    engine = VLLMGenerator(model=str(tmp_path))  # building the component needs no vLLM
    with pytest.raises(ImportError, match="generation: VLLMGenerator needs vLLM, which is not installed here"):
        check_engine(engine)


def test_vllm_engine_without_vllm_fails_before_the_recipe_builds_anything(monkeypatch, tmp_path):
    from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed

    monkeypatch.setitem(sys.modules, "vllm", None)
    cfg = OmegaConf.load(write_config(
        tmp_path, generation={"_component_": "torchtune_grpo.generation.VLLMGenerator", "model": str(tmp_path)}
    ))
    with pytest.raises(ImportError, match="VLLMGenerator needs vLLM"):
        GRPOFullFinetuneRecipeDistributed(cfg)  # before the process group and any model


def test_math_answer_reward_says_it_falls_back_to_the_builtin_comparison(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` raises ImportError
    with caplog.at_level(logging.WARNING):
        reward = MathAnswerReward(backend="auto")
    assert reward.backend == "builtin"
    assert caplog.text.count(
        "MathAnswerReward(backend='auto'): math-verify is not installed, so answers are compared with the "
        "built-in exact comparison only"
    ) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        MathAnswerReward(backend="builtin")  # asked for: nothing to say
    assert "math-verify" not in caplog.text
