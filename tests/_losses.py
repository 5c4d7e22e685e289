"""A test-only loss component: a different GRPOLoss variant at each training step of a run.

Recipe-level checks of split independence compare weights after each step of runs that split the same
global batch differently. Checking every variant in separate runs would cost one `tune run` each; with
``StepCyclingLoss`` one run checks them all: step ``k`` uses ``variants[(k - 1) % len(variants)]``, and
weights saved after every step isolate each variant's update (the weights before step ``k`` already agree).
The step number is the count of :class:`tests._engines.ScriptedGenerator` calls (one per step) since the loss
was built (the recipe's setup), so every run, in a fresh process or after other runs in this one, trains the
same variant at the same step.
"""

from typing import Any, Dict, List, Optional

from torch import nn

from tests import _engines
from torchtune_grpo import loss as losses
from torchtune_grpo.loss import LossOutput


class StepCyclingLoss(nn.Module):
    """Step ``k`` uses ``Loss(**{recipe kwargs, **variants[(k - 1) % len]})``, counting steps from construction.

    ``Loss`` is the class of :mod:`torchtune_grpo.loss` named by the variant's ``_class`` (default
    ``GRPOLoss``).

    Args:
        variants (List[Dict[str, Any]]): loss keyword arguments, one dict per step of the cycle.
        kl_coef (float): from the recipe; a variant may override it. Default is 0.0.
        kl_estimator (str): from the recipe. Default is ``"k3"``.
        max_response_length (Optional[int]): from the recipe. Default is None.
    """

    def __init__(
        self,
        variants: List[Dict[str, Any]],
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        max_response_length: Optional[int] = None,
    ) -> None:
        super().__init__()
        base = {"kl_coef": kl_coef, "kl_estimator": kl_estimator, "max_response_length": max_response_length}
        self.losses = [
            getattr(losses, v.get("_class", "GRPOLoss"))(**{**base, **{k: x for k, x in v.items() if k != "_class"}})
            for v in variants
        ]
        self.entropy_coef = max(loss.entropy_coef for loss in self.losses)
        # Count from here, not from the process's first call: GENERATE_CALLS is process-wide, and an earlier
        # in-process run (another test on the same pytest worker) would otherwise shift the cycle, pairing the
        # variants with other steps' advantages: another workload, whose numbers differ from the one a test's
        # tolerances were derived on (it made tests/test_shared_prompt.py flaky).
        self.first_call = _engines.GENERATE_CALLS

    def forward(self, *args: Any, **kwargs: Any) -> LossOutput:
        return self.losses[(_engines.GENERATE_CALLS - self.first_call - 1) % len(self.losses)](*args, **kwargs)


class StepCyclingAdvantage:
    """Step ``k`` of the run uses ``estimators[(k - 1) % len]`` (each a ``{_component_: ...}`` mapping), as
    :class:`StepCyclingLoss` does for losses: one run checks outcome and token-level estimators. Steps count
    from this object's construction (the recipe's setup), so runs in one process each start the cycle anew."""

    def __init__(self, estimators: List[Dict[str, Any]]) -> None:
        from omegaconf import OmegaConf
        from torchtune import config as tt_config

        self.estimators = [tt_config.instantiate(OmegaConf.create(dict(e))) for e in estimators]
        self.first_call = _engines.GENERATE_CALLS
        self.formula = " | ".join(getattr(e, "formula", type(e).__name__) for e in self.estimators)

    @property
    def current(self) -> Any:
        return self.estimators[(_engines.GENERATE_CALLS - self.first_call - 1) % len(self.estimators)]

    @property
    def token_level(self) -> bool:
        return getattr(self.current, "token_level", False)

    @property
    def uses_batch_stats(self) -> bool:
        return getattr(self.current, "uses_batch_stats", False)

    normalize_components = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.current(*args, **kwargs)
