"""Which training layout a model can run: shared-prompt or packed rows, or one row per sequence.

The shared-prompt rows (:mod:`~torchtune_grpo.training.shared_prompt_rows`) and the packed rows
(:mod:`~torchtune_grpo.training.packed_rows`) run on torchtune's ``MultiHeadAttention`` modules through the
attention replacement of :mod:`torchtune_grpo.models.attention` (:func:`install_shared_prompt_attention`), and on
transformers' own modules (:class:`~torchtune_grpo.models.TransformersDecoder`) as explicit attention masks, for
the families :func:`~torchtune_grpo.models._transformers_layouts.layouts_unsupported` accepts. Any other model
trains one row per sequence; :func:`training_layout` says so (or, asked for explicitly, refuses).
"""

from typing import List, Optional, Tuple

from torch import nn
from torchtune.modules import MultiHeadAttention, TransformerDecoder

from torchtune_grpo.models._transformers_layouts import layouts_unsupported
from torchtune_grpo.models._transformers_policy import TransformersDecoder
from torchtune_grpo.models.attention import install_attention, installable
from torchtune_grpo.training.shared_prompt_rows import shared_row_length

__all__ = ["install_shared_prompt_attention", "shared_prompt_unsupported", "supports_shared_prompt",
           "training_layout"]


def _attention_modules(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


def shared_prompt_unsupported(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot run shared-prompt (and packed) forwards, or None when it can.

    It can when it is a torchtune :class:`~torchtune.modules.TransformerDecoder` (FSDP-wrapped or not) whose
    attention modules are all plain causal self-attention ``MultiHeadAttention`` (LoRA projections are fine)
    and which returns no intermediate hidden states; or transformers' own module
    (:class:`~torchtune_grpo.models.TransformersDecoder`) of a family whose layers
    :func:`~torchtune_grpo.models._transformers_layouts.layouts_unsupported` accepts (explicit masks).
    """
    if isinstance(model, TransformersDecoder):
        return layouts_unsupported(model)
    if not isinstance(model, TransformerDecoder):
        return f"the model is a {type(model).__name__}, not a torchtune TransformerDecoder"
    if model.output_hidden_states:
        return "the model returns intermediate hidden states (output_hidden_states)"
    attns = _attention_modules(model)
    if not attns:
        return "the model has no torchtune MultiHeadAttention modules"
    for a in attns:
        if not installable(a):
            return f"its attention {type(a).__name__} has its own forward"
        if not a.is_causal:
            return "its attention is not causal self-attention"
    return None


def supports_shared_prompt(model: nn.Module) -> bool:
    """Whether ``model`` can run shared-prompt forwards (see :func:`shared_prompt_unsupported`).

    Anything else trains in the unshared layout.
    """
    return shared_prompt_unsupported(model) is None


def install_shared_prompt_attention(model: nn.Module) -> bool:
    """Let ``model``'s attention modules run :class:`SharedPromptMask` forwards (idempotent).

    Every other forward is unchanged. Returns False (and changes nothing) when
    :func:`supports_shared_prompt` is False.
    """
    if not supports_shared_prompt(model):
        return False
    if isinstance(model, TransformersDecoder):
        return True  # its forward turns the layout into explicit masks: nothing to install
    for a in _attention_modules(model):
        install_attention(a)
    return True


def training_layout(
    model: nn.Module,
    *,
    share_prompt: bool,
    explicit: bool,
    max_prompt_length: Optional[int],
    max_response_length: int,
    group_size: int,
    micro_batch_size: int,
    pack: bool = False,
) -> Tuple[bool, Optional[str]]:
    """Whether training forwards share each prompt across its group's rows, and what to tell the user.

    With ``share_prompt`` on and a model that cannot share prompts, the default falls back to one row per
    sequence (same results), said in the returned note; asked for explicitly in the config, it is an error.
    When a shared row can exceed the model's ``max_seq_len``, the note says such micro-batches are computed
    one row per sequence.

    Args:
        model (nn.Module): the policy.
        share_prompt (bool): ``share_prompt_in_training``.
        explicit (bool): whether the config wrote ``share_prompt_in_training`` (rather than the default).
        max_prompt_length (Optional[int]): the longest prompt, or None (unknown).
        max_response_length (int): the response budget.
        group_size (int): completions per prompt.
        micro_batch_size (int): rows per forward.
        pack (bool): ``pack_sequences_in_training`` (packed rows are for one row per sequence: with prompts
            shared, the note says it is not used). Default is False.

    Returns:
        Tuple[bool, Optional[str]]: the layout to use, and a note to log (None: nothing to say).

    Raises:
        ValueError: ``share_prompt_in_training: true`` written in the config, with a model that cannot.
    """
    shared, note = _shared_layout(
        model, share_prompt, explicit, max_prompt_length, max_response_length, group_size, micro_batch_size
    )
    if pack and not shared and (reason := shared_prompt_unsupported(model)) is not None:
        # Packed rows run through the same attention replacement as shared prompts (per-sequence positions and a
        # block mask): a model without it trains one row per sequence, the same results unpacked.
        note = (note + " " if note else "") + (
            f"pack_sequences_in_training: not used, because {reason}; one row per sequence (the same results)."
        )
    if pack and shared:
        note = (note + " " if note else "") + (
            "pack_sequences_in_training: not used, prompts are shared (share_prompt_in_training); packed rows "
            "are for one row per sequence."
        )
    return shared, note


def _shared_layout(
    model: nn.Module, share_prompt: bool, explicit: bool, max_prompt_length: Optional[int],
    max_response_length: int, group_size: int, micro_batch_size: int,
) -> Tuple[bool, Optional[str]]:
    if not share_prompt:
        return False, None
    reason = shared_prompt_unsupported(model)
    if reason is not None:
        if explicit:
            raise ValueError(f"share_prompt_in_training: true, but {reason}. Set share_prompt_in_training: false.")
        return False, (
            f"Training layout: one row per sequence, because {reason} (share_prompt_in_training is on by "
            "default; the results are the same, the prompt is computed once per sequence)."
        )
    max_seq_len = getattr(model, "max_seq_len", None)
    per_row = min(group_size, micro_batch_size)
    longest = None if max_prompt_length is None else shared_row_length(max_prompt_length, max_response_length, per_row)
    if max_seq_len is None or (longest is not None and longest <= max_seq_len):
        return True, None
    shown = "unknown (no max_prompt_length)" if longest is None else longest
    return True, (
        f"Training layout: a micro-batch whose shared-prompt row (prompt + {per_row} completions; longest "
        f"{shown}) exceeds the model's max_seq_len {max_seq_len} is computed one row per sequence (same "
        "results, no prompt sharing for it)."
    )
