"""RolloutGroups.select / concat carry every field by its declared kind (torchtune_grpo/rollouts/groups.py)."""

from dataclasses import fields

import torch

from torchtune_grpo.rollouts.groups import RolloutGroups


def _groups(tag: str, with_logprobs: bool = True) -> RolloutGroups:
    # 2 prompts x 2 completions; every value names its row so a misplaced one shows.
    rows = [f"{tag}{i}" for i in range(4)]
    return RolloutGroups(
        group_size=2, prompts=[f"{tag}p0", f"{tag}p1"], fields=[{"g": f"{tag}0"}, {"g": f"{tag}1"}],
        prompt_ids=[[i] for i in range(4)], response_ids=[[10 + i] for i in range(4)], completions=rows,
        truncated=torch.tensor([False, True, False, True]), rewards=torch.tensor([0.0, 1.0, 2.0, 3.0]),
        per_component={"a": torch.tensor([4.0, 5.0, 6.0, 7.0])}, errors={"a": 1},
        engine_logprobs=[[-float(i)] for i in range(4)] if with_logprobs else None,
        generation_seconds=1.5, reward_seconds=0.25, action_mask=[[1]] * 4,
        conversations=[[{"role": "assistant", "content": r}] for r in rows], episode_info=[{"turns": 1.0}] * 4,
        environment_seconds=0.5,
    )


def test_every_field_declares_how_it_is_carried():
    assert all(f.metadata.get("kind") for f in fields(RolloutGroups))


def test_select_takes_groups_and_their_rows_and_keeps_what_was_scored():
    out = _groups("x").select([1])
    assert out.prompts == ["xp1"] and out.fields == [{"g": "x1"}] and out.completions == ["x2", "x3"]
    assert out.response_ids == [[12], [13]] and out.rewards.tolist() == [2.0, 3.0]
    assert out.truncated.tolist() == [False, True] and out.per_component["a"].tolist() == [6.0, 7.0]
    assert out.engine_logprobs == [[-2.0], [-3.0]] and out.conversations[1][0]["content"] == "x3"
    # errors and timings are those of everything scored, not of the selection
    assert out.errors == {"a": 1} and out.generation_seconds == 1.5 and out.environment_seconds == 0.5


def test_concat_appends_rows_sums_counts_and_drops_a_field_some_parts_lack():
    out = RolloutGroups.concat([_groups("x"), _groups("y", with_logprobs=False)])
    assert out.prompts == ["xp0", "xp1", "yp0", "yp1"] and out.num_groups == 4
    assert out.completions == ["x0", "x1", "x2", "x3", "y0", "y1", "y2", "y3"]
    assert out.rewards.tolist() == [0.0, 1.0, 2.0, 3.0] * 2 and out.per_component["a"].shape == (8,)
    assert out.errors == {"a": 2} and out.generation_seconds == 3.0 and out.reward_seconds == 0.5
    assert out.engine_logprobs is None  # one round without engine logprobs: none for the step
    assert len(out.action_mask) == 8 and out.group_size == 2
