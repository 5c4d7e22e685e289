"""Multi-turn episodes on image prompts (torchtune_grpo/multiturn/): the first turn prefills with the pixels, and a
later turn continues the history after them.

Qwen3.5 (linear attention) gets no session from the native engine (generation/_hf_session.py), nor does any
engine without sessions: every turn re-sends prompt and history, prefilled with the pixels (tested on Qwen3.5, and
on Gemma 3 with its session turned off). Gemma 3 keeps a session, with its sliding windows (later turns attend by
position) or with full attention in every layer: its first turn prefills with the pixels, later turns are text on
the kept cache.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.hf_vision import make_vision_dir
from tests.sampler_records import flip_chance, record_sampler
from tests.test_vision_policy import image_rows, vision_policy
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.generation._hf_session import HFSession
from torchtune_grpo.models import text_after
from torchtune_grpo.multiturn import EnvReply, run_episodes

STOPS = list(range(100, 140))  # 40 of the 512 ids end a turn: turns end at scattered lengths
REPLY = [200, 201, 202]  # the environment's reply, as ids
G = 2


class _Nudge:
    """Answers every turn with the same user message: episodes go on until ``max_turns`` or the budget."""

    def start(self, fields):
        return None

    def step(self, state, message):
        return EnvReply([{"role": "user", "content": "Go on."}], False, {})


class _Turns:
    def reply_ids(self, messages):
        return list(REPLY)


# Ids in and out; no end-of-turn token, so a turn that ends with any stop token continues the episode.
TOKENIZER = SimpleNamespace(pad_id=0, stop_tokens=STOPS, eot_id=None,
                            decode=lambda ids, **kw: " ".join(str(i) for i in ids))


class _Recorded(NativeGenerator):
    """The native engine, each ``generate`` call's sampler steps recorded in a list of its own."""

    def __init__(self, sampled, **kw):
        super().__init__(stop_check_interval=4, **kw)
        self.sampled = sampled

    def generate(self, *args, **kwargs):
        self.sampled.append([])
        return super().generate(*args, **kwargs)


def _image_text_logits(reference, tokens, inputs):
    """transformers' image-text class's next-token logits after ``tokens`` with ``inputs`` (one row)."""
    one = {k: (v[None] if k.endswith("token_type_ids") else v) for k, v in inputs.items()}
    with torch.no_grad():
        return reference(input_ids=torch.tensor([tokens]), **one).logits[0, -1].float()


def _turns(mask):
    """The ``(start, end)`` of each run of 1s of an action mask (the model's turns)."""
    runs, start = [], None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            runs.append((start, j))
            start = None
    return runs


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_episodes_with_images_re_send_the_pixels_every_turn(vision_dir, tmp_path, monkeypatch, family):
    from transformers import AutoModelForImageTextToText

    from torchtune_grpo.models import batch_image_inputs, image_inputs
    from torchtune_grpo.models.logprobs import sequence_logprobs
    from torchtune_grpo.training.batch import TrainingBatch

    directory = vision_dir(family)
    data = image_rows(directory, tmp_path / "data")
    policy = vision_policy(directory, tmp_path / "scratch")
    sampled = record_sampler(monkeypatch)
    engine = _Recorded(sampled)
    prompts, fields = [s["tokens"] for s in data], [dict(s) for s in data]
    images = [s["image_inputs"] for s in data]
    session = engine.session(policy, prompts, group_size=G, max_new_tokens=40, pad_id=0, stop_tokens=STOPS,
                             images=images)
    assert (session is None) == (family == "qwen3_5")  # linear attention: no kept cache; Gemma 3's windows: one
    engine.session = None  # the re-send path, as an engine without sessions (or Qwen3.5) takes it
    episodes = run_episodes(engine, policy, prompts, fields, env=_Nudge(), turns=_Turns(), tokenizer=TOKENIZER,
                            group_size=G, max_new_tokens=40, max_turns=2, generator=torch.Generator().manual_seed(2),
                            temperature=1.0)
    assert len(sampled) == 2, len(sampled)  # the first turn, then one call for every continued row
    continued = [i for i, t in enumerate(episodes.turns) if t == 2]
    assert continued, episodes.turns
    # A continued row's first logits of its second turn: the image-text class's on prompt + history with the pixels.
    # Bound as the one-shot engine's (tests/test_vision_rollout.py): 32 ulp of the largest logit, other batch shapes.
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    for k, i in enumerate(continued):
        start = _turns(episodes.action_mask[i])[1][0]
        history = episodes.prompt_ids[i] + episodes.response_ids[i][:start]
        want = _image_text_logits(reference, history, text_after(images[i // G], start))
        got = sampled[1][0][0][k]
        assert (got - want).abs().max().item() <= 32 * torch.finfo(torch.float32).eps * want.abs().max().item()
    # The trainer's forwards (one right-padded row per episode, with its prompt's images; the environment's tokens
    # are context) give the logprobs of every sampled token that the engine sampled it from. Bound 1e-4 as there.
    batch = TrainingBatch(episodes.prompt_ids, episodes.response_ids, 0, share_prompt=False)
    rows = batch_image_inputs([images[i // G] for i in range(len(episodes.response_ids))], batch.tokens.size(1))
    with torch.no_grad(), image_inputs(policy, rows):
        trainer = sequence_logprobs(policy, batch.tokens, start=batch.start).logprobs
    engine_lp, trainer_lp = [], []
    for i, mask in enumerate(episodes.action_mask):
        offset = len(episodes.prompt_ids[i]) - 1 - batch.start  # column of response token 0 in ``trainer``
        for t, (a, b) in enumerate(_turns(mask)):
            row = i if t == 0 else continued.index(i)
            for j in range(a, b):
                logits, drawn = sampled[t][j - a]
                token = episodes.response_ids[i][j]
                assert int(drawn[row]) == token
                engine_lp.append(torch.log_softmax(logits[row].double(), -1)[token])
                trainer_lp.append(trainer[i, offset + j].double())
    torch.testing.assert_close(torch.stack(trainer_lp), torch.stack(engine_lp), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layers", ["windows", "full"])
def test_a_session_with_images(vision_dir, tmp_path, monkeypatch, layers):
    """Gemma 3 keeps a session, as shipped (6-token windows, shorter than a turn's history: later turns attend by
    position) and with full attention in every layer: its first turn's logits are the image-text class's on the
    pixels, and each turn's tokens are those of re-sending prompt and history with the pixels (the one-shot rollout)
    under the same seed."""
    from transformers import AutoModelForImageTextToText

    directory = vision_dir("gemma3") if layers == "windows" else make_vision_dir(
        "gemma3", tmp_path / "gemma3_full", layer_types=["full_attention"] * 3)
    data = image_rows(directory, tmp_path / "data")
    policy = vision_policy(directory, tmp_path / "scratch")
    sampled = record_sampler(monkeypatch)
    engine = _Recorded(sampled)
    prompts, images = [s["tokens"] for s in data], [s["image_inputs"] for s in data]
    n = len(prompts) * G
    kw = dict(max_new_tokens=10, temperature=1.0)
    with engine.session(policy, prompts, group_size=G, max_new_tokens=60, pad_id=0, stop_tokens=STOPS,
                        images=images) as session:
        assert isinstance(session, HFSession)
        sampled.append([])
        first = session.generate(list(range(n)), [[]] * n, generator=torch.Generator().manual_seed(3), **kw)
        # The first turn's logits: the image-text class's on each prompt with its pixels (32 ulp of the largest).
        reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
        for i, sample in enumerate(data):
            want = _image_text_logits(reference, sample["tokens"], sample["image_inputs"])
            bound = 32 * torch.finfo(torch.float32).eps * want.abs().max().item()
            for row in range(i * G, i * G + G):
                assert (sampled[0][0][0][row] - want).abs().max().item() <= bound
        once = engine.generate(policy, prompts, group_size=G, pad_id=0, stop_tokens=STOPS, images=images,
                               generator=torch.Generator().manual_seed(3), **kw)
        assert first.response_ids == once.response_ids
        # A second turn for the rows whose turn ended with a stop token: text on the kept cache after the images.
        rows = [i for i, r in enumerate(first.response_ids) if r and r[-1] in STOPS]
        assert rows, first.response_ids
        responses = [list(first.response_ids[i]) + REPLY for i in rows]
        sampled.append([])
        cached = session.generate(rows, responses, generator=torch.Generator().manual_seed(4), **kw)
        resent = engine.generate(policy, [prompts[i // G] + r for i, r in zip(rows, responses)], group_size=1,
                                 pad_id=0, stop_tokens=STOPS, generator=torch.Generator().manual_seed(4),
                                 images=[text_after(images[i // G], len(r)) for i, r in zip(rows, responses)], **kw)
    assert cached.prompt_ids == resent.prompt_ids
    assert cached.response_ids == resent.response_ids
    # Equal tokens from logits equal up to rounding (other batch shapes): the chance that a seeded draw fell between
    # the two runs' CDF entries, summed over the turn's rows and steps, bounds how likely a flip was.
    chance = flip_chance(sampled[2], sampled[3]) + flip_chance(sampled[0], sampled[1])
    assert chance < 0.01, chance


class TurnEndingGenerator(NativeGenerator):
    """The native engine with every turn cut to ``turn_tokens`` tokens, the last made ``eot`` (a random model
    rarely samples its end-of-turn token): the recipe's episodes then take their later turns. Turns are cut in
    ``generate``, so it offers no session (every turn re-sends the history)."""

    session = None

    def __init__(self, eot: int, turn_tokens: int = 3, **kw):
        super().__init__(**kw)
        self.eot, self.turn_tokens = int(eot), int(turn_tokens)

    def generate(self, model, prompts, *, max_new_tokens, **kw):
        rollout = super().generate(model, prompts, max_new_tokens=min(max_new_tokens, self.turn_tokens), **kw)
        ids = [list(r[: self.turn_tokens - 1]) + [self.eot] for r in rollout.response_ids]
        return rollout._replace(response_ids=ids, truncated=torch.zeros(len(ids), dtype=torch.bool))


def test_a_grpo_step_of_two_turn_episodes_with_images(vision_dir, tmp_path, clean_env, one_thread, monkeypatch):
    """One step of the image example (tiny Gemma 3) with an environment: both turns of every episode prefill with
    the pixels (the history re-sent after them: the engine cuts turns in generate, so it offers no session), and the
    update's forwards run with the images."""
    from transformers import AutoTokenizer

    from tests.recipe_utils import read_jsonl, run_in_process
    from tests.test_vision_recipe import _example_config, _shapes_dataset, EXAMPLE
    from torchtune_grpo.generation._hf_rollout import HFRollout
    from torchtune_grpo.models import _vision

    prefills, forwards = [], []
    prefill, forward = HFRollout._prefill_with_images, _vision.forward_with_images
    monkeypatch.setattr(HFRollout, "_prefill_with_images",
                        lambda self, ids, *a: prefills.append(ids.size(0)) or prefill(self, ids, *a))
    monkeypatch.setattr(_vision, "forward_with_images",
                        lambda policy, *a: forwards.append(torch.is_grad_enabled()) or forward(policy, *a))
    src = vision_dir("gemma3")
    eot = AutoTokenizer.from_pretrained(src).convert_tokens_to_ids("<end_of_turn>")
    config = _example_config(
        tmp_path, src, _shapes_dataset(tmp_path / "data"), max_steps=1, save_every_n_steps=None, kl_coef=0.0,
        max_response_length=40, environment={"_component_": "tests.test_vision_multiturn._Nudge"},
        multi_turn={"max_turns": 2}, generation={"_component_": "tests.test_vision_multiturn.TurnEndingGenerator",
                                                 "eot": eot},
        **{"reward_functions.0.function": f"{EXAMPLE.parent / 'shape_reward.py'}:names_the_shape"})
    run_in_process(config)
    # Two prompts (one prefill each, shared by the group's 2 rows) in the first turn, then the 4 continued histories.
    assert prefills == [2, 4], prefills
    assert True in forwards  # the update's forward with the images
    metrics = [m for m in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in m]
    assert metrics[0]["episode/turns"] == 2.0 and metrics[0]["episode/injected_tokens"] > 0
