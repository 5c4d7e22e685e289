"""The native generation engine: batched, KV-cached sampling with the torchtune model itself."""

from typing import List, Optional, Sequence

import torch
from torch import nn
from torchtune.modules.common_utils import local_kv_cache

from torchtune_grpo.generation._rollout import Rollout
from torchtune_grpo.generation._sampling import sample_tokens
from torchtune_grpo.logprobs import replace_unembed

__all__ = ["NativeGenerator"]


class NativeGenerator:
    """Sample ``group_size`` completions per prompt with the training model and a KV cache.

    All ``num_prompts x group_size`` rows decode together in one batch. Prompts are left-padded so every
    row's next token sits in the same cache slot; padded slots are masked out of attention and position
    ids skip them, so a row's samples do not depend on how long the other prompts are.

    Args:
        temperature (float): sampling temperature; 0 is greedy. Default is 1.0.
        top_k (Optional[int]): sample only among the ``top_k`` most likely tokens. Default is None.
        top_p (float): nucleus sampling mass. Default is 1.0 (off).
        stop_check_interval (int): check whether every row has stopped once every this many tokens:
            each check is a device-to-host sync. Default is 8.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: float = 1.0,
        stop_check_interval: int = 8,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be positive or null, got {top_k}")
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.stop_check_interval = max(1, stop_check_interval)

    @torch.no_grad()
    def generate(
        self,
        model: nn.Module,
        prompts: List[List[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        pad_id: int,
        stop_tokens: Sequence[int],
        generator: Optional[torch.Generator] = None,
        temperature: Optional[float] = None,
    ) -> Rollout:
        """Generate completions.

        Args:
            model (nn.Module): a torchtune decoder; with FSDP2 its parameters should already be unsharded
                (the recipe does this once per rollout, not once per token).
            prompts (List[List[int]]): B prompts as token ids.
            group_size (int): samples per prompt, G.
            max_new_tokens (int): response budget in tokens.
            pad_id (int): padding id.
            stop_tokens (Sequence[int]): ids that end a response (kept as its last token).
            generator (Optional[torch.Generator]): RNG on the model's device. Default is None.
            temperature (Optional[float]): override this engine's temperature (0 for greedy
                evaluation). Default is None.

        Returns:
            Rollout: ``B x G`` rows; row ``i`` belongs to prompt ``i // G``.
        """
        temperature = self.temperature if temperature is None else temperature
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        n = len(prompts) * group_size
        prompt_len = max(len(p) for p in prompts)
        total_len = prompt_len + max_new_tokens

        # [B, P] left-padded prompts and [B, S] validity of every cache slot.
        prompt = torch.full((len(prompts), prompt_len), pad_id, dtype=torch.long)
        valid = torch.ones((len(prompts), total_len), dtype=torch.bool)
        for i, p in enumerate(prompts):
            prompt[i, prompt_len - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[i, : prompt_len - len(p)] = False
        prompt = prompt.to(device).repeat_interleave(group_size, dim=0)  # [N, P]
        valid = valid.to(device).repeat_interleave(group_size, dim=0)  # [N, S]
        input_pos = (valid.cumsum(-1) - 1).clamp(min=0)  # [N, S]
        causal = torch.tril(torch.ones(total_len, total_len, dtype=torch.bool, device=device))
        # A padded query row would attend to nothing (NaN softmax): let it see itself.
        prefill_mask = (causal[:prompt_len][None] & valid[:, None, :]) | torch.eye(
            prompt_len, total_len, dtype=torch.bool, device=device
        )  # [N, P, S]

        stop = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
        out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)

        def last_logits(h: torch.Tensor) -> torch.Tensor:
            # Project only the last position: the prefill never needs [N, P, V].
            return model.output(model.norm(h[:, -1])).float()  # [N, V]

        steps = 0
        with local_kv_cache(
            model, batch_size=n, device=device, dtype=dtype, decoder_max_seq_len=total_len
        ), replace_unembed(model, last_logits):
            logits = model(prompt, mask=prefill_mask, input_pos=input_pos[:, :prompt_len])
            for t in range(max_new_tokens):
                token = sample_tokens(
                    logits,
                    temperature=temperature,
                    top_k=self.top_k,
                    top_p=self.top_p,
                    generator=generator,
                )
                token = token.masked_fill(done, pad_id)
                out[:, t] = token
                done |= torch.isin(token, stop)
                steps = t + 1
                if steps == max_new_tokens:
                    break
                if steps % self.stop_check_interval == 0 and bool(done.all()):
                    break
                pos = prompt_len + t
                step_mask = (causal[pos][None, None, :] & valid[:, None, :])  # [N, 1, S]
                logits = model(
                    token[:, None], mask=step_mask, input_pos=input_pos[:, pos : pos + 1]
                )

        return _to_rollout(prompts, group_size, out[:, :steps], done, stop)


def _to_rollout(
    prompts: List[List[int]],
    group_size: int,
    out: torch.Tensor,
    done: torch.Tensor,
    stop: torch.Tensor,
) -> Rollout:
    """Cut each row after its first stop token. ``out`` is ``[N, steps]``."""
    n, steps = out.shape
    is_stop = torch.isin(out, stop)
    # Length = index of the first stop token + 1, or every step when none came.
    first_stop = torch.where(
        is_stop.any(-1), is_stop.int().argmax(-1) + 1, torch.full_like(done, steps, dtype=torch.long)
    )
    rows = out.cpu().tolist()
    lengths = first_stop.cpu().tolist()
    response_ids = [row[:length] for row, length in zip(rows, lengths)]
    prompt_ids = [list(p) for p in prompts for _ in range(group_size)]
    return Rollout(prompt_ids=prompt_ids, response_ids=response_ids, truncated=~done.cpu())
