"""Linear-attention layers under the packed and shared-prompt layouts: each sequence on a row of its own.

Qwen3.5's Gated DeltaNet layers (``linear_attention`` in ``config.layer_types``) carry state along a row: a short
causal convolution over the last few tokens, then the gated delta rule's running state. transformers' torch path
takes no sequence boundaries, so on a row holding several sequences one sequence's state would flow into the next.
Softmax attention is told the boundaries by the layout's masks (:mod:`._transformers_layouts`); these layers are
told them by taking the rows apart. Under a layout, each such layer:

1. gathers each sequence's slots into a right-padded row of its own: a packed sequence alone, a shared prompt's
   real tokens followed by one of its completions (the prompt slots are every completion's context);
2. runs transformers' own forward of the layer on those rows (a causal layer: right padding changes nothing
   before it, and a fresh state starts each row);
3. puts each slot's output back where the slot is (a shared prompt's slots from its first completion's row, where
   they are computed exactly as on every other; padding slots get zeros).

The attention, MLP and norm layers still run on the layout's rows, so the layout keeps most of its saving; a
shared prompt is recomputed once per completion in these layers only. Gradients are exact: the gather and the
scatter are indexing, and the repeated prompt copies' gradients sum back onto the prompt's slots.

The plan (:class:`SequenceRows`) rides in the ``attention_mask`` transformers passes to each layer (the
``"linear_attention"`` entry of the mask dict), so activation checkpointing's recomputation sees it too.
"""

import types
from typing import Any, Callable, List

import torch

__all__ = ["SequenceRows", "recurrent_layers", "split_sequences"]

LINEAR_ATTENTION = "linear_attention"
_MODULE_NAME = "linear_attn"  # the mixer's attribute in transformers' Qwen3.5 decoder layers (dense and MoE)
_INSTALLED = "_grpo_sequence_rows"
_FOUND = "_grpo_recurrent_layers"


class SequenceRows:
    """Where each sequence of a layout's rows lies, as index tensors. ``R`` rows, ``S`` slots, ``N`` sequences of
    at most ``L`` slots.

    Attributes:
        gather (torch.Tensor): ``[N, L]`` long: the flat slot (``r * S + s``) of each sequence's token; ``R * S``
            (a zero slot) after its end.
        source (torch.Tensor): ``[R * S]`` long: where each slot's output is in the flat ``[N * L]`` outputs;
            ``N * L`` (a zero) for padding.
    """

    def __init__(self, pairs: Any):
        """Plan the rows of ``pairs`` (its ``segment`` and ``shared``, ``[R, S]``; read on the host once).

        Args:
            pairs (Any): the layout's :class:`~torchtune_grpo.models._transformers_layouts.SlotPairs`.
        """
        segment, shared = pairs.segment.cpu(), pairs.shared.cpu()
        r, s = segment.shape
        sequences: List[List[int]] = []
        source = torch.full((r * s,), -1, dtype=torch.long)
        for row in range(r):
            seg, common = segment[row], shared[row]
            prefix = (common.nonzero().flatten() + row * s).tolist()  # seen by every segment of the row
            ids = [i for i in seg.unique().tolist() if i >= 0]
            # Segments with tokens of their own first (completions, packed sequences); a segment that is all
            # shared (a prompt) is covered by them, and only gets a row when the row has nothing else.
            own = {i: ((seg == i) & ~common).nonzero().flatten() + row * s for i in ids}
            covered = set()
            for i in sorted(ids, key=lambda i: own[i].numel() == 0):
                slots = own[i].tolist()
                if not slots and covered.issuperset(prefix):
                    continue
                sequences.append(prefix + slots)
                covered.update(prefix)
        length = max((len(q) for q in sequences), default=1)
        gather = torch.full((len(sequences), length), r * s, dtype=torch.long)
        for n, slots in enumerate(sequences):
            gather[n, : len(slots)] = torch.tensor(slots, dtype=torch.long)
            fresh = source[slots] < 0  # a shared prompt's slots keep their first sequence
            source[torch.tensor(slots)[fresh]] = n * length + torch.arange(len(slots))[fresh]
        source[source < 0] = len(sequences) * length
        device = pairs.segment.device
        self.gather, self.source = gather.to(device), source.to(device)
        self.shape = (r, s)

    def run(self, forward: Callable[..., torch.Tensor], hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``forward`` (the layer's own, ``[N, L, H] -> [N, L, H]``) on each sequence's row; ``hidden [R, S, H]``
        -> ``[R, S, H]``."""
        r, s, h = hidden.shape
        if (r, s) != self.shape:
            raise ValueError(f"a linear-attention layer got rows of shape {(r, s)}, its layout has {self.shape}")
        flat = torch.cat([hidden.reshape(r * s, h), hidden.new_zeros(1, h)])
        out = forward(flat[self.gather], cache_params=None, attention_mask=None, **kwargs)  # [N, L, H]
        flat_out = torch.cat([out.reshape(-1, h), out.new_zeros(1, h)])
        return flat_out[self.source].view(r, s, h)


def _forward(self: torch.nn.Module, hidden_states: torch.Tensor, cache_params: Any = None,
             attention_mask: Any = None, **kwargs: Any) -> torch.Tensor:
    """The layer's forward, or, given a :class:`SequenceRows` for a mask, the same forward on each sequence."""
    own = types.MethodType(type(self).forward, self)
    if isinstance(attention_mask, SequenceRows):
        return attention_mask.run(own, hidden_states, **kwargs)
    return own(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)


def recurrent_layers(causal_lm: torch.nn.Module) -> List[torch.nn.Module]:
    """The linear-attention mixers of transformers' ``causal_lm`` (``linear_attn`` of each such decoder layer),
    found once per model: every layout forward asks (wrappers added later wrap these same modules)."""
    found = causal_lm.__dict__.get(_FOUND)
    if found is None:
        found = [m for name, m in causal_lm.named_modules() if name.rpartition(".")[2] == _MODULE_NAME]
        causal_lm.__dict__[_FOUND] = found
    return found


def split_sequences(causal_lm: torch.nn.Module) -> None:
    """Let ``causal_lm``'s linear-attention layers take a :class:`SequenceRows` plan as their mask (once per
    model; a bound method of the instance, so copies of the model keep their own)."""
    for layer in recurrent_layers(causal_lm):
        if not getattr(layer, _INSTALLED, False):
            layer.forward = types.MethodType(_forward, layer)
            setattr(layer, _INSTALLED, True)
