"""An engine that samples with transformers' ``generate`` from the trainer's current weights.

:class:`TransformersGenerator` is the sampler TRL's GRPOTrainer uses, as an engine of this recipe: at every
``generate`` call it copies the trainer's (gathered) weights into a Hugging Face model of the same directory
and samples with ``model.generate`` (multinomial, temperature, top-k/top-p as configured). It serves two
purposes: a reference sampler, to tell whether a difference in learning comes from the native engine's
sampling or from the update (docs/benchmarks/closed_loop.md), and transformers' own ``generate`` as a second
sampler for any architecture transformers knows (the native engine samples those with its own decode loop on
transformers' cache: :mod:`~torchtune_grpo.generation._hf_rollout`).

Its samples come from the trainer's weights of the moment (like the native engine, ``holds_weights`` is
False: no weight sync). With ``dtype`` other than the trainer's (a bf16 sampler of fp32 weights) it is a
different distribution, and it reports its own sampling logprobs (``Rollout.logprobs``: after temperature,
top-k and top-p, as vLLM's ``processed_logprobs``) so the sampler/trainer mismatch is measured
(``generation/logprob_mismatch``) and the rollout correction can act on it. For a mixture-of-experts model it
records the experts each token was routed to (``Rollout.routed_experts``, prompt tokens included, from the
prefill) for routing replay. It decodes one batch with left padding and no prefix caching, so it is slower
than the native engine; it is a reference, not the default.

Image prompts (``generate(..., images=...)``, a policy with its image side: docs/multimodal.md): it samples with
the directory's image-text class (``AutoModelForImageTextToText``) whose language model and head are the copy of
the trainer's weights above, and whose vision tower and projector are copies of the policy's (refreshed at every
call, so a trained projector samples as trained). Each row gets its prompt's processed image inputs (repeated to
the group's ``G`` rows), and ``generate`` runs the family's own image prefill (features on the image tokens, Gemma 3's
bidirectional image attention, Qwen3.5's M-RoPE positions), then decodes text.
"""

from contextlib import nullcontext
from itertools import chain
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_grpo.generation._engine import GenerationEngine
from torchtune_grpo.generation._output import Rollout
from torchtune_grpo.generation._publisher import full_weights
from torchtune_grpo.generation._weight_sync import TuneToHFNames
from torchtune_grpo.models import read_hf_config, text_model_config
from torchtune_grpo.models.moe_routing import router_hooks

__all__ = ["TransformersGenerator", "routes_of_generate", "sample_with_generate"]


class TransformersGenerator(GenerationEngine):
    """Sampling with transformers' ``generate`` from the trainer's weights (see the module docstring).

    Args:
        model (str): the Hugging Face model directory the policy was built from (its ``config.json``).
        temperature (float): sampling temperature (> 0). Default is 1.0.
        top_k (Optional[int]): keep the k most likely tokens; None: all. Default is None.
        top_p (float): nucleus sampling mass; 1.0: all. Default is 1.0.
        dtype (Optional[str]): the Hugging Face model's dtype; None: the trainer's weights' dtype. Default is None.
    """

    holds_weights = False
    takes_images = True

    def __init__(
        self, model: str, temperature: float = 1.0, top_k: Optional[int] = None, top_p: float = 1.0,
        dtype: Optional[str] = None,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"TransformersGenerator samples: temperature must be > 0, got {temperature}")
        self.model_dir = str(model)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = float(top_p)
        self.dtype = dtype
        self._hf: Optional[nn.Module] = None
        self._image_text: Optional[nn.Module] = None
        self._names: Optional[TuneToHFNames] = None

    def check_available(self) -> None:
        """Fail now if transformers cannot build the model of ``model``'s ``config.json``."""
        read_hf_config(self.model_dir)

    def _hf_model(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            config = text_model_config(self.model_dir)  # a multimodal directory's language model
            dtype = getattr(torch, self.dtype) if self.dtype else dtype
            self._hf = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
            self._names = TuneToHFNames(read_hf_config(self.model_dir))
        return self._hf

    @torch.no_grad()
    def _load(self, policy: nn.Module, device: torch.device) -> "tuple[nn.Module, Dict[str, torch.Tensor]]":
        """The Hugging Face model holding the policy's current weights (every rank gathers: a collective), and the
        policy's trained vision tensors (``train_vision``: its ``trained_vision.*`` state, gathered; else empty)."""
        from torchtune_grpo.models._vision import TRAINED_PREFIX

        hf = None
        loaded: Dict[str, torch.Tensor] = {}
        trained: Dict[str, torch.Tensor] = {}
        for name, tensor in full_weights(policy, device):
            if name.startswith(TRAINED_PREFIX + "."):  # not the language model's: for _with_images
                trained[name] = tensor
                continue
            if hf is None:
                hf = self._hf_model(tensor.dtype if tensor.is_floating_point() else torch.float32, device)
            hf_name, value = self._names(name, tensor)
            loaded[hf_name] = value
        missing, unexpected = hf.load_state_dict(loaded, strict=False)
        tied = {"lm_head.weight"} if getattr(hf.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"TransformersGenerator: weights do not fit {self.model_dir}: missing "
                             f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        return hf, trained

    @torch.no_grad()
    def _with_images(self, hf: nn.Module, image_model: nn.Module, trained: Mapping[str, torch.Tensor]) -> nn.Module:
        """The directory's image-text class around ``hf`` (its language model and head, the same modules) with
        copies of ``image_model``'s (the policy's) vision modules, their weights refreshed from the policy.

        ``trained``: the policy's trained vision tensors, gathered (``trained_vision.<module>.<name>``, the
        module's dots as ``__``); FSDP2 shards those modules, so the copies take them from here. The frozen rest
        is whole on every process, and FSDP2 leaves buffers whole: those are read off ``image_model``.
        """
        from torch.distributed.tensor import DTensor

        from torchtune_grpo.models._vision import TRAINED_PREFIX

        param = next(hf.parameters())
        if self._image_text is None:
            from transformers import AutoConfig, AutoModelForImageTextToText

            # Built on the meta device: the language model and head are hf's, the vision modules are allocated
            # here and filled below (not copied: an FSDP2-wrapped module cannot be deep-copied).
            with torch.device("meta"):
                full = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(self.model_dir),
                                                               dtype=param.dtype)
            full.lm_head = hf.lm_head
            for name, _ in image_model.named_children():
                if name == "language_model":
                    setattr(full.model, name, hf.model)
                else:
                    full.model.get_submodule(name).to_empty(device=param.device).requires_grad_(False)
            self._image_text = full.eval()
        # Module path -> its tensors, from the gathered trained_vision.<module>.<name>.
        whole = {}
        for key, value in trained.items():
            module, _, leaf = key[len(TRAINED_PREFIX) + 1:].partition(".")
            whole[f"{module.replace('__', '.')}.{leaf}"] = value
        for name, child in image_model.named_children():
            if name == "language_model":
                continue
            target = self._image_text.model.get_submodule(name)
            own = dict(chain(target.named_parameters(), target.named_buffers()))
            given = dict(chain(child.named_parameters(), child.named_buffers()))
            if own.keys() != given.keys():
                raise ValueError(f"TransformersGenerator: the image-text class of {self.model_dir} has {name} "
                                 f"tensors the policy's image side does not give, or the reverse: "
                                 f"{sorted(own.keys() ^ given.keys())[:5]}")
            for key, tensor in given.items():
                value = whole.get(f"{name}.{key}", tensor)  # the trainer's current vision weights
                if isinstance(value, DTensor):
                    raise ValueError(f"TransformersGenerator: {name}.{key} is sharded and was not gathered")
                own[key].copy_(value)
        return self._image_text

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
        images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None,
    ) -> Rollout:
        """``group_size`` sampled completions of each prompt, each cut after its first stop token.

        Args:
            model (nn.Module): the trainer's policy (torchtune; plain or FSDP2-sharded).
            prompts (List[List[int]]): prompt token ids.
            group_size (int): completions per prompt.
            max_new_tokens (int): the response budget.
            pad_id (int): the padding id.
            stop_tokens (Sequence[int]): ids that end a completion (kept as its last token).
            generator (Optional[torch.Generator]): seeds the sampling (transformers draws from torch's global
                RNG: a seed drawn from ``generator`` is used inside a forked RNG, so the global stream is left
                alone). Default is None.
            temperature (Optional[float]): overrides the engine's; 0 is greedy. Default is None.
            images (Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]]): each prompt's image inputs (as
                :class:`~torchtune_grpo.data.ImagePromptDataset` gives them) or None; the policy must have its
                image side (:func:`~torchtune_grpo.models.attach_images`). Default is None.

        Returns:
            Rollout: ``prompt_ids``, ``response_ids`` ``[N]`` lists, ``truncated [N]`` (no stop token within the
            budget); ``logprobs`` when its dtype differs from the trainer's weights' (else None: the trainer
            computes the same ones); ``routed_experts`` for a mixture-of-experts model.

        Raises:
            ValueError: images for a policy without an image side.
        """
        device = next(model.parameters()).device
        has_images = images is not None and any(i is not None for i in images)
        if has_images and getattr(model, "image_model", None) is None:
            raise ValueError("prompts with images: the policy has no image side (a transformers policy of a "
                             "multimodal directory, with attach_images)")
        hf, trained = self._load(model, device)
        inputs = None
        if has_images:
            from torchtune_grpo.models import batch_image_inputs

            hf = self._with_images(hf, model.image_model, trained)
            dtype = next(hf.parameters()).dtype
            # Row i answers prompt i // G: each row its prompt's images, per-token types aligned to the left padding.
            inputs = batch_image_inputs([images[i // group_size] for i in range(len(prompts) * group_size)],
                                        max(len(p) for p in prompts), device, left=True)
            inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        temp = self.temperature if temperature is None else float(temperature)
        # Its own distribution when it computes in another dtype than the trainer's weights: report it.
        trainer_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        own_logprobs = next(hf.parameters()).dtype != trainer_dtype
        return sample_with_generate(
            hf, prompts, group_size=group_size, max_new_tokens=max_new_tokens, pad_id=pad_id,
            stop_tokens=stop_tokens, generator=generator, temperature=temp, top_k=self.top_k, top_p=self.top_p,
            with_logprobs=own_logprobs, model_inputs=inputs,
        )

    def close(self) -> None:
        self._hf = None
        self._image_text = None


@torch.no_grad()
def sample_with_generate(
    hf: nn.Module,
    prompts: List[List[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    pad_id: int,
    stop_tokens: Sequence[int],
    generator: Optional[torch.Generator],
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    with_logprobs: bool = False,
    model_inputs: Optional[Mapping[str, torch.Tensor]] = None,
) -> Rollout:
    """``group_size`` completions of each prompt sampled by transformers' ``generate`` on ``hf``.

    Rows are left-padded (every row's last prompt token in the last column) with an attention mask, so a
    row's samples do not depend on the other prompts' lengths; transformers' own KV cache (sliding-window and
    linear-attention state included) serves the decode.

    Args:
        hf (nn.Module): a transformers causal LM (a copy of the weights, or a transformers policy's own module).
        prompts (List[List[int]]): prompt token ids.
        group_size (int): completions per prompt.
        max_new_tokens (int): the response budget.
        pad_id (int): the padding id.
        stop_tokens (Sequence[int]): ids that end a completion (kept as its last token).
        generator (Optional[torch.Generator]): seeds the sampling (transformers draws from torch's global RNG:
            a seed drawn from ``generator`` is used inside a forked RNG, so the global stream is left alone).
        temperature (float): 0 is greedy.
        top_k (Optional[int]): keep the k most likely tokens; None: all.
        top_p (float): nucleus sampling mass; 1.0: all.
        with_logprobs (bool): also return each sampled token's log-probability under the distribution it was
            sampled from (after temperature, top-k, top-p). Default is False.
        model_inputs (Optional[Mapping[str, torch.Tensor]]): more inputs of ``hf.generate`` for the
            ``B x group_size`` rows (an image-text class's ``pixel_values``, ...). Default is None.

    Returns:
        Rollout: ``prompt_ids``, ``response_ids`` ``[N]`` lists, ``truncated [N]``; ``logprobs`` with
        ``with_logprobs``; ``routed_experts`` when ``hf`` is a mixture of experts (:func:`routes_of_generate`).
    """
    device = next(hf.parameters()).device
    rows = [list(p) for p in prompts for _ in range(group_size)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, device=device)
        mask[i, width - len(r):] = 1
    options: Dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, eos_token_id=list(stop_tokens), pad_token_id=pad_id,
        do_sample=temperature > 0, num_beams=1,
    )
    if temperature > 0:
        options.update(temperature=temperature, top_k=top_k or 0, top_p=top_p)
    if with_logprobs:  # the scores generate sampled from: logits after its processors and warpers
        options.update(output_scores=True, return_dict_in_generate=True)
    hooks = router_hooks(hf)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item()) if generator is not None else None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        with hooks.recording() if hooks is not None else nullcontext() as recorded:
            out = hf.generate(input_ids=ids, attention_mask=mask, **options, **(model_inputs or {}))
    sequences = out.sequences if with_logprobs else out
    stops = set(int(t) for t in stop_tokens)
    responses, truncated = [], []
    for row in sequences[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        responses.append(row[: cut + 1] if cut is not None else row[:max_new_tokens])
        truncated.append(cut is None)
    logprobs = None
    if with_logprobs:
        steps = len(out.scores)
        sampled = sequences[:, width: width + steps]  # [B, steps]
        chosen = torch.stack([  # [B, steps]: step j's log-probability of the token it sampled
            torch.log_softmax(score.float(), dim=-1).gather(-1, sampled[:, j: j + 1]).squeeze(-1)
            for j, score in enumerate(out.scores)
        ], dim=1)
        logprobs = [chosen[i, : len(resp)].tolist() for i, resp in enumerate(responses)]
    routes = None
    if recorded is not None:
        routes = routes_of_generate(recorded, rows, responses, width)
    return Rollout(rows, responses, torch.tensor(truncated, dtype=torch.bool), logprobs=logprobs,
                   routed_experts=routes)


def routes_of_generate(
    recorded: List[List[torch.Tensor]], rows: List[List[int]], responses: List[List[int]], width: int
) -> List[torch.Tensor]:
    """Each row's routes from the indices the routers used during ``generate`` (one prefill, then one token).

    Args:
        recorded (List[List[torch.Tensor]]): per MoE layer, per forward, ``[B x S, k]`` int16: the prefill
            (``S = width``, left-padded rows) then one decode step per generated token (``S = 1``).
        rows (List[List[int]]): the ``B`` prompts, unpadded.
        responses (List[List[int]]): the ``B`` kept responses.
        width (int): the padded prompt width.

    Returns:
        List[torch.Tensor]: per row ``[len(prompt) + len(response), layers, k]`` int16: the prompt's tokens from
        the prefill (left padding stripped), response token ``j`` from decode step ``j`` (its forward as an
        input); -1 for the last response token (sampled, never an input).

    Raises:
        RuntimeError: when generate's forwards are not one prefill of ``width`` then single tokens.
    """
    b = len(rows)
    per_forward = [torch.stack(f, dim=1) for f in zip(*recorded)]  # each [B*S, layers, k]
    if not per_forward or per_forward[0].size(0) != b * width or any(f.size(0) != b for f in per_forward[1:]):
        raise RuntimeError(f"routing record: transformers' generate ran forwards of {[f.size(0) for f in per_forward]} "
                           f"tokens; expected one prefill of {b} x {width} then {b} per step")
    prefill = per_forward[0].view(b, width, *per_forward[0].shape[1:])  # [B, W, layers, k]
    steps = torch.stack(per_forward[1:], dim=1) if len(per_forward) > 1 else prefill[:, :0]  # [B, steps, layers, k]
    out = []
    for i, (prompt, resp) in enumerate(zip(rows, responses)):
        r = torch.full((len(prompt) + len(resp), *prefill.shape[2:]), -1, dtype=torch.int16)
        r[: len(prompt)] = prefill[i, width - len(prompt):]
        known = min(max(len(resp) - 1, 0), steps.size(1))  # the last response token is never an input
        r[len(prompt): len(prompt) + known] = steps[i, :known]
        out.append(r)
    return out
