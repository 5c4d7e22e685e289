"""GDPO-style per-component reward normalisation (advantages.normalize_components) and high-entropy token
selection (token_selection.HighEntropyTokens): values by hand, split independence, metrics, and one in-process
recipe run with both."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipe_utils import read_jsonl, recipe_in_process, write_config
from torchtune_grpo.rollouts.advantages import BatchStdAdvantage, GroupRelativeAdvantage, normalize_components
from torchtune_grpo.training.step_metrics import step_metrics
from torchtune_grpo.loss.token_selection import HighEntropyTokens

S = 1 / math.sqrt(2.0)  # 0.707107: a group of two values normalised by its sample std


def _components():
    # G = 2, two groups. correct = [1, 0 | 1, 1] (group 1 constant), fmt = [0, 0.5 | 0.2, 0], weights 1 and 0.5.
    return {"correct": torch.tensor([1.0, 0.0, 1.0, 1.0]), "fmt": torch.tensor([0.0, 0.5, 0.2, 0.0])}, [1.0, 0.5]


def test_components_are_normalised_within_their_groups():
    # correct, group 0: [1, 0] -> mean 0.5, sample std 0.707107 -> z = [0.707107, -0.707107]; group 1 constant -> 0.
    # fmt: group 0 [0, 0.5] -> z = [-0.707107, 0.707107]; group 1 [0.2, 0] -> [0.707107, -0.707107]; x 0.5.
    # sum: [0.707107 - 0.353553, -0.707107 + 0.353553, 0.353553, -0.353553] = [0.353553, -0.353553, 0.353553, -0.353553]
    comps, weights = _components()
    out = normalize_components(comps, weights, group_size=2)
    # Not rounding but the eps = 1e-6 added to each std: a group [a, a + d] gives +-(d/2) / (d/sqrt2 + 1e-6) =
    # +-S (1 - sqrt2 1e-6 / d): d = 1 -> 1.0e-6 off S, d = 0.5 -> 2.0e-6, d = 0.2 (fmt's group 1) -> 5.0e-6
    # (x 0.5 weight: 2.5e-6). fp32 rounding (mean, std, divide at ~0.7: ~3e-7) adds little, in any kernel.
    # Bound: 1e-5.
    torch.testing.assert_close(out.per_component["correct"], torch.tensor([S, -S, 0.0, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.per_component["fmt"], torch.tensor([-S, S, S, -S]) / 2, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.rewards, torch.tensor([S, -S, S, -S]) / 2, atol=1e-5, rtol=0)
    assert out.zero_std["correct"].tolist() == [False, True] and out.zero_std["fmt"].tolist() == [False, False]
    # Without it, the weighted sum [1, 0.25 | 1.1, 1.0] gives group 1 the full +-0.707107 from the format
    # reward's 0.1 spread: it weighs as much as group 0's correctness difference.
    total = comps["correct"] + 0.5 * comps["fmt"]
    plain = GroupRelativeAdvantage()(total, 2).advantages
    # Group 1 is [1.1, 1.0]: d = 0.1 (fp32 1.1 - 1.0), so eps = 1e-6 puts it S sqrt2 1e-6 / 0.1 = 1.0e-5 below S
    # (rounding: ~3e-7). Bound: 1e-4.
    torch.testing.assert_close(plain, torch.tensor([S, -S, S, -S]), atol=1e-4, rtol=0)  # float32 1.1 - 1.0
    # GDPO's batch normalisation: BatchStdAdvantage on the sum (group mean already 0); batch sample std of
    # four values +-0.353553 is sqrt(4 * 0.125 / 3) = 0.408248 -> +-0.866025.
    gdpo = BatchStdAdvantage(normalize_components=True)(out.rewards, 2).advantages
    # 0.866025 is sqrt(3)/2 to 6 digits (4e-7 off), the batch std's eps 1e-6 shifts the ratio by 0.866 x 1e-6 /
    # 0.408 = 2e-6 relative, the rewards' eps shifts (above) cancel in part in the ratio: a few 1e-6 in all.
    # Bound: 1e-5.
    torch.testing.assert_close(gdpo, torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.866025, atol=1e-5, rtol=0)


def test_component_metrics_by_hand():
    # correct's share [0.707107, -0.707107, 0, 0]: mean 0, population std sqrt(1 / 4) = 0.5; 1 of 2 groups constant.
    # fmt's share +-0.353553 four times: std 0.353553; no group constant.
    comps, weights = _components()
    sums = normalize_components(comps, weights, 2).sums()
    m = step_metrics({**_base_sums(), **sums.as_dict(), ("trained",): 4.0})
    # correct's share is +-S (1 - 1.4e-6) (the std's eps above): its population std is 0.5 (1 - 1.4e-6), 7e-7 below
    # 0.5, plus a few roundings at 0.5 (6e-8 each). Bound: 1e-6. The mean is z - z + 0 + 0 = 0 exactly (+-0.5 / the
    # same std): 1e-7. fmt's std: eps shifts of 1e-6 and 2.5e-6 (above) at S/2 = 0.35. Bound: 1e-5.
    assert m["advantage/correct/std"] == pytest.approx(0.5, abs=1e-6)
    assert m["advantage/correct/mean"] == pytest.approx(0.0, abs=1e-7)
    assert m["advantage/correct/zero_std_fraction"] == 0.5
    assert m["advantage/fmt/std"] == pytest.approx(S / 2, abs=1e-5)  # float32 0.2
    assert m["advantage/fmt/zero_std_fraction"] == 0.0


def _base_sums():
    from torchtune_grpo.training.step_metrics import LOSS_METRICS, STEP_METRICS

    keys = {key for metric in STEP_METRICS.values() for key in metric if isinstance(key, tuple)}
    return {**dict.fromkeys(keys, 1.0), **{("update", name): 1.0 for name in LOSS_METRICS}}


def test_component_normalisation_errors_and_formula():
    comps, _ = _components()
    with pytest.raises(ValueError, match="1 weights for 2 reward components"):
        normalize_components(comps, [1.0], 2)
    with pytest.raises(ValueError, match="multiple of group_size"):
        normalize_components({"r": torch.ones(3)}, [1.0], 2)
    assert "[GDPO]" in GroupRelativeAdvantage(normalize_components=True).formula
    assert "GDPO" not in GroupRelativeAdvantage().formula


def test_top_fraction_threshold_by_hand():
    # 10 tokens with entropies 0.1 .. 1.0; q = 0.2 -> keep ceil(0.2 * 10) = 2: threshold 0.9 (0.9 and 1.0).
    # q = 0.25 -> ceil(2.5) = 3: threshold 0.8. Ties at the threshold are kept.
    values = torch.arange(1, 11, dtype=torch.float32) / 10
    # Thresholds are elements of ``values``: k / 10 rounded once to fp32 (<= 3e-8 relative). Bound: approx's 1e-6
    # relative.
    assert HighEntropyTokens(0.2).threshold(values) == pytest.approx(0.9)
    assert HighEntropyTokens(0.25).threshold(values) == pytest.approx(0.8)
    assert HighEntropyTokens(1.0).threshold(values) == pytest.approx(0.1)
    assert HighEntropyTokens(0.2).threshold(torch.zeros(0)) == float("-inf")
    # 5 response tokens (7.0 is padding): q = 0.6 keeps ceil(3) = 3 -> threshold 0.75, which two tokens tie at:
    # 4 kept (ties are kept), the 0.5 token and the padding are not.
    entropy = torch.tensor([[0.75, 0.5, 1.0], [0.75, 0.875, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    threshold = HighEntropyTokens(0.6).threshold(entropy[mask])
    assert threshold == 0.75
    assert HighEntropyTokens(0.6).select(entropy, mask, threshold).tolist() == [[True, False, True], [True, True, False]]
    with pytest.raises(ValueError, match="token_selection.fraction"):
        HighEntropyTokens(0.0)


def test_global_threshold_is_independent_of_the_split():
    # Two "ranks" gather their masked entropies: the threshold (and so the selection) is that of the whole
    # batch whatever the split, and exactly ceil(q * M) tokens are kept when entropies are distinct.
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(8, 6, generator=g) * 4
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([5, 1, 0, 3, 6, 2, 4, 6]).unsqueeze(1)
    sel = HighEntropyTokens(0.2)
    whole = sel.select(entropy, mask, sel.threshold(entropy[mask]))
    for parts in ([slice(0, 4), slice(4, 8)], [slice(0, 3), slice(3, 5), slice(5, 8)]):
        threshold = sel.threshold(torch.cat([entropy[p][mask[p]] for p in parts]))
        split = torch.cat([sel.select(entropy[p], mask[p], threshold) for p in parts])
        assert torch.equal(split, whole)
    assert whole.sum().item() == math.ceil(0.2 * mask.sum().item())  # 27 tokens -> 6 kept


@pytest.mark.slow
def test_recipe_with_both_options_in_process(tmp_path, clean_env, one_thread):
    # GRPO on the tiny model with GDPO normalisation of its 3 rewards and only the top 30% entropy tokens:
    # the card states both, per-component stats are logged, weights move.

    cfg = OmegaConf.load(write_config(
        tmp_path, max_steps=2, save_every_n_steps=None,
        advantage={"_component_": "torchtune_grpo.rollouts.advantages.BatchStdAdvantage", "normalize_components": True},
        token_selection={"fraction": 0.3},
    ))
    with recipe_in_process(cfg) as recipe:
        before = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
        recipe.train()
        assert any(not torch.equal(v, before[k]) for k, v in recipe.model.state_dict().items())
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    names = [r.get("name") or r._component_.rsplit(".", 1)[-1] for r in cfg.reward_functions]
    for m in metrics:
        assert math.isfinite(m["loss"])
        assert any(m[k] > 0 for k in m if k.startswith("advantage/") and k.endswith("/std")), m
    assert {f"advantage/{n}/std" for n in ("format", "correctness")} <= metrics[0].keys(), (names, metrics[0].keys())
    card = (tmp_path / "out" / "algorithm_card.md").read_text()
    assert "each reward component normalised within its group" in card
    assert "only the top 0.3 of response tokens by entropy" in card
