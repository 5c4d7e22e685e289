"""A step's rollouts: prompts in, scored completion groups out.

``groups`` (:class:`RolloutGroups` and ``sample_and_score``, the one place that samples and scores),
``producer`` (the prompt stream and the in-process rollout source), ``group_selection`` (the groups a step
trains on: DAPO's dynamic sampling), ``advantages`` (one advantage per completion, from its group), ``process_advantages`` (one per token,
from step scores),
``evaluation`` (held-out accuracy) and ``rejection_sampling`` (``tune-grpo rs``). Import from the modules; this file imports nothing.
"""
