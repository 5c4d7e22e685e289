"""Policy losses of the GRPO family, each a YAML ``loss._component_``.

- :class:`GRPOLoss`: PPO clip on the token ratio (GRPO, DAPO, Dr. GRPO) or on the sequence ratio (GSPO);
- :class:`CISPOLoss`, :class:`GMPOLoss`, :class:`SAPOLoss`: CISPO, GMPO and SAPO policy terms;

all sharing aggregation, KL, entropy bonus and importance weights (:mod:`torchtune_grpo.loss.base`), and
the KL estimators (:mod:`torchtune_grpo.loss.kl`). docs/algorithms.md states every formula.
"""

from torchtune_grpo.loss.base import LOSS_AGG_MODES, LossOutput, PolicyGradientLoss, PolicyTerm
from torchtune_grpo.loss.grpo import RATIO_LEVELS, GRPOLoss, ppo_formula_lines
from torchtune_grpo.loss.kl import KL_ESTIMATORS, kl_estimate, kl_reward_penalty
from torchtune_grpo.loss.policies import CISPOLoss, GMPOLoss, SAPOLoss

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "RATIO_LEVELS",
    "CISPOLoss",
    "GMPOLoss",
    "GRPOLoss",
    "LossOutput",
    "PolicyGradientLoss",
    "PolicyTerm",
    "SAPOLoss",
    "kl_estimate",
    "kl_reward_penalty",
    "ppo_formula_lines",
]
