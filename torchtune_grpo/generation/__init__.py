"""Generation engines: sample ``group_size`` completions per prompt."""

from torchtune_grpo.generation._engine import check_engine, GenerationEngine, GenerationSession
from torchtune_grpo.generation._native import NativeGenerator
from torchtune_grpo.generation._publisher import full_weights, WeightPublisher
from torchtune_grpo.generation._output import Rollout, decode_responses
from torchtune_grpo.generation._sampling import sample_tokens
from torchtune_grpo.generation._transformers import TransformersGenerator
from torchtune_grpo.generation._vllm import VLLMGenerator
from torchtune_grpo.generation._vllm_server import VLLMServerGenerator
from torchtune_grpo.generation._vllm_routes import request_routes
from torchtune_grpo.generation._vllm_server_process import VLLMServerError
from torchtune_grpo.generation._weight_sync import TuneToHFNames, WeightSyncCheck, WeightSyncError

__all__ = [
    "GenerationEngine",
    "GenerationSession",
    "NativeGenerator",
    "Rollout",
    "TransformersGenerator",
    "TuneToHFNames",
    "VLLMGenerator",
    "VLLMServerError",
    "VLLMServerGenerator",
    "WeightPublisher",
    "WeightSyncCheck",
    "WeightSyncError",
    "check_engine",
    "decode_responses",
    "full_weights",
    "request_routes",
    "sample_tokens",
]
