"""A reward that the environment decided: a number from the episode's summed step infos (docs/environments.md)."""

from torchtune_grpo.rewards import Reward, RewardSample

__all__ = ["EpisodeInfoReward"]


class EpisodeInfoReward(Reward):
    """Scores each multi-turn episode with one of the numbers its environment reported (summed over its steps).

    Environments that compute the reward themselves (an OpenEnv server's step rewards, a verifiers rubric) put it
    in their step infos (``env_reward``); the rollout sums infos per episode into ``fields["episode"]``.

    Args:
        key (str): the info to read. Default is ``"env_reward"``.
        name (str): the component's name. Default is ``"env_reward"``.

    Raises:
        ValueError: (that sample gets the fallback) for a single-turn rollout, which has no ``episode`` field.
    """

    name = "env_reward"

    def __init__(self, key: str = "env_reward", name: str = "env_reward") -> None:
        self.key, self.name = key, name

    def score_one(self, sample: RewardSample) -> float:
        episode = sample.fields.get("episode")
        if not isinstance(episode, dict):
            raise ValueError("EpisodeInfoReward scores multi-turn episodes (set environment: and multi_turn:); this "
                             "sample has no `episode` field")
        # An episode whose environment never reported the key (e.g. it ended before any step) scores 0.
        return float(episode.get(self.key, 0.0))
