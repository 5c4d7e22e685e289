"""Components used only by the fault tests (tests/test_faults.py)."""

import torch


class PoisonedAdamW(torch.optim.AdamW):
    """AdamW that writes an infinity into the first weight after its ``poison_at``-th step (1-based), as a
    numerically broken optimizer or an overflowing update would; the gradients stay finite."""

    def __init__(self, params, poison_at: int = 2, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.poison_at = poison_at
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        self.steps += 1
        if self.steps == self.poison_at:
            weight = self.param_groups[0]["params"][0]
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            local.view(-1)[0] = float("inf")
        return out
