"""transformers' own causal LM as the GRPO policy, behind the interface the recipe trains.

The recipe drives a policy as it drives a torchtune ``TransformerDecoder``: ``model(tokens, mask=None,
input_pos=None)`` ends with ``model.unembed(h)`` (final norm + output projection), which the logprob code
replaces to compute per-token log-probabilities chunk by chunk inside the root module's forward (FSDP2 keeps
the root's parameters gathered only there); ``model.norm``, ``model.output``, ``model.layers``,
``model.tok_embeddings`` and ``model.max_seq_len`` are what else it reads. :class:`TransformersDecoder` gives
transformers' ``AutoModelForCausalLM`` module that interface without changing it:

- its children (``model``, ``lm_head``) are registered under their own names, so the state dict holds the
  checkpoint's own tensor names and FSDP2's per-layer condition (``...layers.N``) finds the decoder layers;
- ``norm`` is the identity (transformers' base model applies the final norm itself);
- ``output`` (:class:`TransformersHead`) runs the causal LM's own ``forward`` on given hidden states, so
  whatever the family does after the projection (Gemma's final soft-capping, a logit scale) is applied
  because the model does it, not because a list here names it. When that forward is exactly a bias-free
  matrix product (checked once on the weights, bit for bit), the fused chunked logprob kernel is used.

Tied embeddings are one parameter (the input embedding), as in torchtune's ``TiedLinear``: the head reads the
embedding's weight, and the state dict has no ``lm_head.weight`` (nor do tied checkpoints on disk).
"""

from typing import Any, Dict, Optional, Set

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TransformersDecoder", "TransformersHead", "build_transformers_decoder"]


class _HiddenStatesOnly:
    """What a stubbed base model returns: ``last_hidden_state``, and None for every other output field."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> Any:  # only reached for fields not set above
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 0:
            return self.last_hidden_state
        raise IndexError(index)


class _StubBase(nn.Module):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> _HiddenStatesOnly:
        return _HiddenStatesOnly(self.hidden)


def _input_in_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    hidden, *rest = args
    return (hidden.to(module.weight.dtype), *rest)


class _TiedHead(nn.Module):
    """The output projection of a tied model: the input embedding's weight, not a parameter of its own."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # not a child: one parameter, one name

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embedding.weight)


class TransformersHead(nn.Module):
    """The causal LM's own computation from final hidden states to logits.

    Args:
        causal_lm (nn.Module): a transformers ``...ForCausalLM`` (held, not registered: its parameters belong
            to :class:`TransformersDecoder`).
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "causal_lm", causal_lm)
        self._plain: Optional[bool] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` final hidden states -> ``[..., V]`` logits, by the causal LM's ``forward``."""
        lead = hidden.shape[:-1]
        lm = self.causal_lm
        prefix = lm.base_model_prefix
        base = lm._modules[prefix]
        # The causal LM's forward with its base model answering ``hidden``: the projection and everything
        # the family applies after it, exactly as transformers computes logits.
        lm._modules[prefix] = _StubBase(hidden.reshape(1, -1, hidden.size(-1)))
        try:
            logits = lm(input_ids=None, use_cache=False).logits
        finally:
            lm._modules[prefix] = base
        return logits.reshape(*lead, logits.size(-1))

    def linear_weight(self) -> Optional[torch.Tensor]:
        """The ``[V, D]`` weight when :meth:`forward` is exactly ``F.linear(h, weight)``, else None.

        Decided once, the first time it is asked (inside the root's forward, where FSDP2 has gathered the
        weight), by comparing both on a small random input bit for bit.
        """
        weight = self.causal_lm.get_output_embeddings().weight
        if self._plain is None:
            gen = torch.Generator(device="cpu").manual_seed(0)
            probe = torch.randn(2, weight.size(1), generator=gen).to(device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                self._plain = bool(torch.equal(self(probe), F.linear(probe, weight)))
        return weight if self._plain else None


class TransformersDecoder(nn.Module):
    """A transformers causal LM trained as this recipe trains torchtune decoders (see the module docstring).

    Args:
        causal_lm (nn.Module): a transformers ``...ForCausalLM`` (its parameters may be on the meta device).
        max_seq_len (int): the longest sequence the recipe may feed it.
        buffers (Dict[str, torch.Tensor]): non-persistent buffers (RoPE frequencies, embedding scales) computed
            at construction, restored on the device by :meth:`restore_buffers` after meta-device init.
        backend_note (str): which backend and attention implementation, for the log and the algorithm card.
    """

    def __init__(self, causal_lm: nn.Module, max_seq_len: int, buffers: Dict[str, torch.Tensor],
                 backend_note: str = "") -> None:
        super().__init__()
        embedding = causal_lm.get_input_embeddings()
        head = causal_lm.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is embedding.weight:
            causal_lm.set_output_embeddings(_TiedHead(embedding))
        # With FSDP2 mixed precision the root (embeddings, final norm, head) keeps fp32 parameters while the
        # decoder layers hand it bf16: the head takes its input in its weight's dtype (in training the final-norm
        # hook already did; transformers' generate() calls the head directly).
        causal_lm.get_output_embeddings().register_forward_pre_hook(_input_in_weight_dtype)
        for name, child in causal_lm.named_children():
            if name in ("norm", "output"):
                raise ValueError(f"{type(causal_lm).__name__} has a child module named {name!r}, which this wrapper uses")
            self.add_module(name, child)
        if any(True for _ in causal_lm.named_parameters(recurse=False)):
            raise ValueError(f"{type(causal_lm).__name__} has parameters outside its child modules; not supported")
        object.__setattr__(self, "causal_lm", causal_lm)
        self.norm = nn.Identity()  # the base model's forward applies the final norm
        self.output = TransformersHead(causal_lm)
        self.max_seq_len = int(max_seq_len)
        self.config = causal_lm.config
        self.backend_note = backend_note
        self._buffer_values = buffers
        self._root_initialised = False

    @property
    def base(self) -> nn.Module:
        """The base model (embeddings, decoder layers, final norm)."""
        return self._modules[self.causal_lm.base_model_prefix]

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (FSDP2 shards each; activation checkpointing wraps each)."""
        return self.base.layers

    @property
    def tok_embeddings(self) -> nn.Module:
        """The input embedding (an ``nn.Embedding`` or a subclass, e.g. Gemma's scaled one)."""
        return self.causal_lm.get_input_embeddings()

    @property
    def layer_classes(self) -> Set[type]:
        """The decoder layers' classes (what activation checkpointing wraps)."""
        return {type(getattr(layer, "_checkpoint_wrapped_module", layer)) for layer in self.layers}

    def sampler(self) -> nn.Module:
        """The causal LM itself, for transformers' ``generate`` on the live weights.

        ``generate`` calls the causal LM's forward, not this module's. FSDP2 decides which module is the root
        at the first forward: run one 1-token forward through this module first, so that the decoder layers
        are not taken for roots themselves (FSDP2 then refuses every later forward through this one).
        """
        if not self._root_initialised:
            from torch.distributed.fsdp import FSDPModule

            if isinstance(self, FSDPModule):
                device = self.tok_embeddings.weight.device
                with torch.no_grad():
                    self(torch.zeros(1, 1, dtype=torch.long, device=device))
            self._root_initialised = True
        return self.causal_lm

    def restore_buffers(self, device: torch.device) -> None:
        """Put the non-persistent buffers computed at construction on ``device`` (after meta-device init)."""
        for name, value in self._buffer_values.items():
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            module._buffers[leaf] = value.to(device)

    def forward(self, tokens: torch.Tensor, mask: Optional[Any] = None,
                input_pos: Optional[torch.Tensor] = None, images: Optional[Dict[str, torch.Tensor]] = None
                ) -> torch.Tensor:
        """Logits (or whatever ``unembed`` returns) of ``tokens``.

        Args:
            tokens (torch.Tensor): ``[B, L]`` token ids: right-padded rows (a plain causal mask is then exact), or
                a training layout's rows.
            mask (Optional[Any]): None (transformers' attention builds its own causal and sliding-window masks),
                or a training layout's :class:`~torchtune_grpo.models.attention.AttentionLayout` (packed or
                shared-prompt rows), turned into explicit masks by :mod:`._transformers_layouts`.
            input_pos (Optional[torch.Tensor]): ``[B, L]`` position ids; None: ``0..L-1``. A layout needs them.
            images (Optional[Dict[str, torch.Tensor]]): the rows' image inputs
                (:func:`~torchtune_grpo.models._vision.batch_image_inputs`; or set for a block by
                :func:`~torchtune_grpo.models._vision.image_inputs`), after
                :func:`~torchtune_grpo.models._vision.attach_images`: the image-text class's own forward on the
                policy's language model: right-padded plain rows (no ``input_pos``), or a layout's rows with the images laid
                out in its slots (:func:`~torchtune_grpo.models._vision_layouts.layout_image_inputs`).

        Returns:
            torch.Tensor: ``unembed(h)``, by default ``[B, L, V]`` logits.

        Raises:
            ValueError: for a tensor mask, or a layout on a model :func:`layouts_unsupported` refuses.
        """
        images = images if images is not None else self.__dict__.get("_pending_images")
        if images is not None:
            from torchtune_grpo.models._vision import forward_with_images

            if mask is not None and not hasattr(mask, "pairs"):
                raise ValueError("a forward with images takes plain right-padded rows or a training layout (packed "
                                 "or shared-prompt rows), not a tensor mask")
            return self.unembed(forward_with_images(self, tokens, images, input_pos, mask))
        attention_mask = None
        if mask is not None:
            from torchtune_grpo.models._transformers_layouts import layout_attention_mask

            if not hasattr(mask, "pairs") or input_pos is None:
                raise ValueError("the transformers backend takes no tensor mask: None (plain causal rows) or a "
                                 "training layout (packed or shared-prompt rows, with their input_pos)")
            attention_mask = layout_attention_mask(self, mask.pairs(input_pos))
        out = self.base(input_ids=tokens, position_ids=input_pos, attention_mask=attention_mask, use_cache=False)
        return self.unembed(out.last_hidden_state)

    def unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits (replaced on the instance by the logprob code)."""
        return self.output(self.norm(hidden))


def build_transformers_decoder(
    config: Any, *, max_seq_len: Optional[int] = None, attn_implementation: Optional[str] = None,
    dtype: Optional[torch.dtype] = None, reason: str = "",
) -> TransformersDecoder:
    """transformers' causal LM for ``config`` behind :class:`TransformersDecoder`'s interface.

    Args:
        config (Any): a transformers ``PretrainedConfig`` of a causal LM (a multimodal checkpoint's text config).
        max_seq_len (Optional[int]): at most this many positions; None: ``max_position_embeddings``.
        attn_implementation (Optional[str]): transformers' attention implementation (``"sdpa"``, ``"eager"``,
            ``"flash_attention_2"``, ...); None: transformers' default for the family.
        dtype (Optional[torch.dtype]): the parameters' dtype; None: torch's default dtype.
        reason (str): why this backend, for the note.

    Returns:
        TransformersDecoder: the model; under a meta default device (as the recipes build models) its parameters
        are on the meta device (to be loaded), else on the default device, randomly initialised.

    Raises:
        ValueError: when ``max_seq_len`` exceeds ``max_position_embeddings``.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    positions = int(getattr(config, "max_position_embeddings", None) or 1 << 20)
    if max_seq_len is not None and max_seq_len > positions:
        raise ValueError(f"max_seq_len = {max_seq_len} exceeds the model's max_position_embeddings = {positions}")
    dtype = dtype or torch.get_default_dtype()
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if torch.get_default_device().type == "meta":
        # Built under the recipes' meta device: parameters on the meta device (loaded later, each rank its
        # shards), buffers computed on the CPU: RoPE frequencies and embedding scales are not in the checkpoint
        # and must be the model's own.
        with torch.device("cpu"), init_empty_weights(include_buffers=False):
            causal_lm = AutoModelForCausalLM.from_config(config, **kwargs)
        # accelerate's meta parameters replace the tied head's shared parameter by a copy: tie again.
        causal_lm.tie_weights()
    else:  # a usable model on the default device, randomly initialised (as torchtune's builders give)
        causal_lm = AutoModelForCausalLM.from_config(config, **kwargs)
    persistent = set(causal_lm.state_dict().keys())
    buffers = {name: b.detach().clone() for name, b in causal_lm.named_buffers() if name not in persistent}
    attention = getattr(causal_lm.config, "_attn_implementation", None) or attn_implementation or "default"
    note = f"transformers {type(causal_lm).__name__} (attention: {attention}){'; ' + reason if reason else ''}"
    return TransformersDecoder(causal_lm, max_seq_len or positions, buffers, backend_note=note)


def text_model_config(path: str) -> Any:
    """The transformers config of a directory's language model.

    A multimodal checkpoint (a ``text_config`` inside: Qwen3.5, Gemma 3 4B+, Gemma 4) gives its text config,
    with the top-level ``tie_word_embeddings`` (which decides tying for those checkpoints).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    text = getattr(config, "text_config", None)
    if text is None or text is config:
        return config
    top = config.to_dict()
    if "tie_word_embeddings" in top:
        text.tie_word_embeddings = bool(top["tie_word_embeddings"])
    return text
