"""Memory of a mixture-of-experts GRPO run on paper, from a ``config.json`` and a shipped config's batch.

    python benchmarks/moe_memory.py /tmp/Qwen3-30B-A3B --recipe-config configs/qwen3_moe/30B-A3B_full_grpo.yaml --gpus 8
    python benchmarks/moe_memory.py /tmp/Qwen3-30B-A3B --recipe-config configs/qwen3_moe/30B-A3B_lora_grpo.yaml --gpus 1
    python benchmarks/moe_memory.py --hub Qwen3-30B-A3B ...     # in a clone: the published config.json (tests/)

The first argument is a model directory or its ``config.json`` (a multimodal one, as Qwen3.5-MoE's, is read from
its ``text_config``). Families: ``qwen3_moe``, ``qwen3_5_moe`` (Gated DeltaNet and gated attention layers, a shared
expert), ``gpt_oss`` (biases, sinks), ``olmoe``, ``mixtral``. :func:`parameter_counts` counts every tensor
transformers' module holds (tests/test_moe_memory.py checks it against ``sum(p.numel())``);
:func:`memory_rows` turns the counts and the batch into per-GPU bytes under FSDP2, each row with its formula.

What the rows assume (the recipe's ``dtype: bf16``, torchtune_grpo/runtime/precision.py): full fine-tuning keeps
fp32 master weights, fp32 gradients and two fp32 AdamW moments, all sharded N ways; FSDP2 all-gathers one decoder
layer at a time in bf16 (and prefetches the next), and in the backward holds that layer's unsharded gradient in
bf16 and in fp32 for the reduce-scatter; for a rollout the native engine gathers the whole model on every rank
(:func:`memory_rows`). ``fsdp_cpu_offload: true`` moves the shards (and the optimizer step) to host memory. LoRA
keeps the frozen base in bf16 (sharded), the adapters with their gradients and AdamW moments in bf16 (8 bytes
each). Activations are counted from the tensors autograd keeps in transformers 5.19's modules
(:func:`layer_activation_elements`, checked exactly on a tiny layer of each family on CPU); GPU kernels (flash
attention, grouped-GEMM experts) keep others. The GPU check's MoE stage (benchmarks/gpu_moe.py) measures a peak to
compare with.
"""

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["Row", "Setup", "language_fields", "layer_activation_elements", "lora_parameters", "memory_rows",
           "parameter_counts", "read_config", "setup_from_recipe_config"]

GB = 1e9
MOE_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "gpt_oss", "olmoe", "mixtral")


def read_config(path: Any) -> Dict[str, Any]:
    """The language model's fields of a ``config.json``, or of the one in a model directory
    (:func:`language_fields`)."""
    path = Path(path)
    return language_fields(json.loads((path / "config.json" if path.is_dir() else path).read_text()), str(path))


def language_fields(data: Mapping[str, Any], source: str = "config.json") -> Dict[str, Any]:
    """A ``config.json``'s language-model fields: a multimodal checkpoint's ``text_config``, with the top-level
    ``tie_word_embeddings`` where the file puts it there.

    Raises:
        ValueError: the model is not one of the mixture-of-experts families above (naming its ``model_type``), or
            has dense layers among the sparse ones (naming the key).
    """
    text = dict(data.get("text_config") or data)
    text.setdefault("tie_word_embeddings", data.get("tie_word_embeddings", False))
    if text.get("model_type") == "qwen3_5_moe":
        text["model_type"] = "qwen3_5_moe_text"
    if text.get("model_type") not in MOE_TYPES:
        raise ValueError(f"{source}: model_type {text.get('model_type')!r} is not one of {MOE_TYPES}")
    if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{source}: dense layers among the sparse ones (mlp_only_layers = "
                         f"{text.get('mlp_only_layers')}, decoder_sparse_step = {text.get('decoder_sparse_step')}) are "
                         "not counted here: every layer must be a mixture of experts")
    return text


def _dims(c: Mapping[str, Any]) -> Dict[str, int]:
    h = c["hidden_size"]
    heads = c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    e = c.get("num_experts") or c.get("num_local_experts")
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    d = dict(H=h, V=c["vocab_size"], L=c["num_hidden_layers"], Dq=heads * hd, Dkv=c["num_key_value_heads"] * hd,
             hd=hd, heads=heads, E=e, k=c["num_experts_per_tok"], I=inter,
             Is=c.get("shared_expert_intermediate_size", 0))
    if c["model_type"] == "qwen3_5_moe_text":
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        d.update(conv=2 * nk * c["linear_key_head_dim"] + nv * c["linear_value_head_dim"],
                 Dz=nv * c["linear_value_head_dim"], nv=nv, dk=c["linear_key_head_dim"], dv=c["linear_value_head_dim"],
                 kernel=c["linear_conv_kernel_dim"])
    return d


def layer_types(c: Mapping[str, Any]) -> List[str]:
    """Each decoder layer's token mixer: ``full_attention``, ``sliding_attention`` or ``linear_attention``."""
    if c.get("layer_types"):
        return list(c["layer_types"])
    if c["model_type"] == "qwen3_5_moe_text":
        every = c.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(c["num_hidden_layers"])]
    return ["full_attention"] * c["num_hidden_layers"]


def _linears(c: Mapping[str, Any], kind: str) -> Dict[str, tuple]:
    """The token mixer's linear layers of one layer of ``kind``: name -> (in, out, has bias)."""
    d, t = _dims(c), c["model_type"]
    if kind == "linear_attention":  # Gated DeltaNet
        return {"in_proj_qkv": (d["H"], d["conv"], False), "in_proj_z": (d["H"], d["Dz"], False),
                "in_proj_b": (d["H"], d["nv"], False), "in_proj_a": (d["H"], d["nv"], False),
                "out_proj": (d["Dz"], d["H"], False)}
    bias = bool(c.get("attention_bias"))
    q_out = 2 * d["Dq"] if t == "qwen3_5_moe_text" else d["Dq"]  # Qwen3.5's gated attention: query and gate
    return {"q_proj": (d["H"], q_out, bias), "k_proj": (d["H"], d["Dkv"], bias), "v_proj": (d["H"], d["Dkv"], bias),
            "o_proj": (d["Dq"], d["H"], bias)}


def parameter_counts(c: Mapping[str, Any]) -> Dict[str, int]:
    """Every parameter of transformers' causal LM for ``c`` (:func:`read_config`), by part.

    Returns:
        Dict[str, int]: ``embedding``, ``head`` (0 when tied), ``attention`` (token mixers and their norms, all
        layers), ``norms`` (the two per layer and the final one), ``routers``, ``experts``, ``shared_experts``,
        ``total``, ``largest_layer`` (one decoder layer's, what FSDP2 gathers at once) and ``active``
        (parameters a token's forward multiplies with: its top-k experts, not all E).
    """
    d, t = _dims(c), c["model_type"]
    parts = dict(embedding=d["V"] * d["H"], head=0 if c.get("tie_word_embeddings") else d["V"] * d["H"],
                 attention=0, norms=d["H"], routers=0, experts=0, shared_experts=0)
    largest = active_layers = 0
    for kind in layer_types(c):
        mixer = sum(i * o + (o if b else 0) for i, o, b in _linears(c, kind).values())
        if kind == "linear_attention":  # conv1d [conv, 1, kernel], dt_bias, A_log [nv], gated RMSNorm [dv]
            mixer += d["conv"] * d["kernel"] + 2 * d["nv"] + d["dv"]
        elif t in ("qwen3_moe", "qwen3_5_moe_text"):
            mixer += 2 * d["hd"]  # q_norm, k_norm over one head
        elif t == "olmoe":
            mixer += d["Dq"] + d["Dkv"]  # q_norm, k_norm over all heads
        elif t == "gpt_oss":
            mixer += d["heads"]  # attention sinks
        router = d["E"] * d["H"] + (d["E"] if t == "gpt_oss" else 0)
        one_expert = 3 * d["H"] * d["I"] + (2 * d["I"] + d["H"] if t == "gpt_oss" else 0)  # gate, up, down (+ biases)
        shared = 3 * d["H"] * d["Is"] + d["H"] if d["Is"] else 0  # the shared expert and its sigmoid gate
        parts["attention"] += mixer
        parts["norms"] += 2 * d["H"]
        parts["routers"] += router
        parts["experts"] += d["E"] * one_expert
        parts["shared_experts"] += shared
        layer = mixer + 2 * d["H"] + router + d["E"] * one_expert + shared
        largest = max(largest, layer)
        active_layers += layer - (d["E"] - d["k"]) * one_expert
    parts["total"] = sum(parts.values())
    parts["largest_layer"] = largest
    parts["active"] = active_layers + parts["embedding"] + parts["head"] + d["H"]
    return parts


# torchtune's LoRA target names -> the family's layer (as torchtune_grpo.models' LoRA maps them).
_LORA_NAMES = {"output_proj": "o_proj"}


def lora_parameters(c: Mapping[str, Any], targets: Sequence[str], rank: int) -> int:
    """Adapter parameters of rank ``rank`` on ``targets`` (torchtune's or the family's layer names) in every
    layer that has them: ``rank x (in + out)`` per adapted linear layer."""
    total = 0
    for kind in layer_types(c):
        linears = _linears(c, kind)
        names = {_LORA_NAMES.get(t, t) for t in targets}
        total += sum(rank * (linears[n][0] + linears[n][1]) for n in names if n in linears)
    return total


# Per family, from the tensors transformers 5.19's modules keep for the backward (measured with autograd's
# saved-tensor hooks on tiny layers: tests/test_moe_memory.py checks the count exactly): elements of H per RMSNorm
# (its fp32 input, its output, the copy the next linear layer keeps; gpt-oss and Qwen3.5 keep an fp32 output),
# and elements of I per expert copy besides its input and output (gate and up, the activation's intermediates).
_NORM_H = {"qwen3_moe": 4, "olmoe": 4, "mixtral": 4, "gpt_oss": 5, "qwen3_5_moe_text": 5}
_EXPERT_I = {"qwen3_moe": 4, "olmoe": 4, "qwen3_5_moe_text": 4, "mixtral": 4, "gpt_oss": 7}


def layer_activation_elements(c: Mapping[str, Any], kind: str, seq_len: int) -> int:
    """Elements autograd keeps per token in one decoder layer of ``kind`` for sequences of ``seq_len`` tokens,
    counted in bf16 units (an fp32 tensor counts twice, an int64 four times), in transformers' modules:

    - two RMSNorms, ``_NORM_H`` x H each, and their fp32 inverse norms;
    - attention through SDPA: q and k after RoPE, v and the output, 2 (Dq + Dkv), and SDPA's fp32 log-sum-exp
      per head; q/k norms (Qwen3-MoE, OLMoE) add their fp32 inputs and bf16 outputs, 3 (Dq + Dkv), Qwen3.5's
      (fp32 outputs) 4 (Dq + Dkv), and their inverse norms; Qwen3.5's output gate 3 Dq. gpt-oss has no SDPA
      path (attention sinks): eager attention keeps q, and k and v repeated to every query head, and the output
      (4 Dq), the probabilities over ``seq_len + 1`` keys (the sink) per head, and an int64 per head;
    - Gated DeltaNet (Qwen3.5's linear attention): the in-projections, the convolution's output and the gated
      norm's input and output, 3 conv + 3 Dz, a lower bound (transformers' torch fallback keeps fp32 chunks);
    - the router: fp32 logits 2 E, the int64 top-k indices, and the fp32 weights and their sum where they are
      renormalised (gpt-oss: top-k of the logits, softmax over the k in bf16); the dispatch's int64 index
      vectors of k per token (three; gpt-oss four);
    - each of the k expert copies: its gathered input and weighted output 2 H, ``_EXPERT_I`` x I, its routing
      weight (fp32 for Mixtral); Qwen3.5's shared expert 4 Is, its gated output H and its gate.

    Not per token, so not here: the few parameter-sized fp32 copies some layers keep (Qwen3.5's ``1 + weight``
    norm scales) and an int32 expert count.
    """
    d, t = _dims(c), c["model_type"]
    H, Dq, Dkv, heads, k = d["H"], d["Dq"], d["Dkv"], d["heads"], d["k"]
    kv_heads = Dkv // d["hd"]
    norms = 2 * (_NORM_H[t] * H + 2)
    if kind == "linear_attention":
        mixer = 3 * d["conv"] + 3 * d["Dz"]
    elif t == "gpt_oss":
        mixer = 4 * Dq + heads * (seq_len + 1) + 4 * heads
    else:
        mixer = 2 * (Dq + Dkv) + 2 * heads
        if t == "qwen3_moe":
            mixer += 3 * (Dq + Dkv) + 2 * (heads + kv_heads)
        elif t == "olmoe":  # q and k normalised across all heads at once
            mixer += 3 * (Dq + Dkv) + 2 * 2
        elif t == "qwen3_5_moe_text":
            mixer += 4 * (Dq + Dkv) + 2 * (heads + kv_heads) + 3 * Dq
    if t == "gpt_oss":
        router, dispatch = 4 * k + k, 4 * 4 * k
    else:
        renormalised = t in ("mixtral", "qwen3_5_moe_text") or bool(c.get("norm_topk_prob"))
        router, dispatch = 2 * d["E"] + 4 * k + ((2 * k + 2) if renormalised else 0), 3 * 4 * k
    experts = k * (2 * H + _EXPERT_I[t] * d["I"] + (2 if t == "mixtral" else 1))
    shared = (4 * d["Is"] + H + 1) if d["Is"] else 0
    return norms + mixer + router + dispatch + experts + shared


def _cache_bytes_per_row(c: Mapping[str, Any], tokens: int) -> int:
    """Generation memory of one row of ``tokens``: K and V in bf16 for softmax layers (a sliding layer keeps
    its window), the fp32 recurrent state and the convolution window for Gated DeltaNet layers."""
    d, total = _dims(c), 0
    for kind in layer_types(c):
        if kind == "linear_attention":
            total += d["nv"] * d["dk"] * d["dv"] * 4 + d["conv"] * (d["kernel"] - 1) * 2
        else:
            kept = min(tokens, c.get("sliding_window") or tokens) if kind == "sliding_attention" else tokens
            total += 2 * d["Dkv"] * 2 * kept
    return total


@dataclass(frozen=True)
class Setup:
    """The run the table is for. ``rows``: sequences one GPU generates at once (batch_size x group_size);
    ``micro_batch``, ``seq_len`` (prompt + response), ``chunk`` (logprob_chunk_size), ``kl_reference`` (full
    fine-tuning with kl_coef > 0 holds a bf16 reference), ``cpu_offload`` (``fsdp_cpu_offload``: the shards in
    host memory), ``lora_rank``/``lora_targets`` (None: full)."""

    gpus: int
    rows: int
    micro_batch: int
    seq_len: int
    chunk: int
    activation_checkpointing: bool = True
    kl_reference: bool = False
    cpu_offload: bool = False
    lora_rank: Optional[int] = None
    lora_targets: Sequence[str] = ()


def setup_from_recipe_config(path: Any, gpus: int) -> Setup:
    """The :class:`Setup` of a shipped YAML config (its batch, lengths, LoRA keys and kl_coef) on ``gpus``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    lora = "lora" in str(cfg.model._component_).rsplit(".", 1)[-1]
    return Setup(gpus=gpus, rows=int(cfg.batch_size) * int(cfg.group_size), micro_batch=int(cfg.micro_batch_size),
                 seq_len=int(cfg.max_prompt_length) + int(cfg.max_response_length),
                 chunk=int(cfg.get("logprob_chunk_size", 512)),
                 activation_checkpointing=bool(cfg.get("enable_activation_checkpointing", True)),
                 kl_reference=not lora and float(cfg.get("kl_coef", 0.0)) > 0,
                 cpu_offload=bool(cfg.get("fsdp_cpu_offload", False)),
                 lora_rank=int(cfg.model.lora_rank) if lora else None,
                 lora_targets=list(cfg.model.lora_attn_modules) if lora else ())


@dataclass(frozen=True)
class Row:
    """One line of the table: what, how it is computed, bytes per GPU (per process), and whether it is held on
    the device for the whole run (``static``), while training (``train``), while generating (``generate``), in
    host memory (``host``, with ``fsdp_cpu_offload``), or is a total (``host total``, ``peak``)."""

    name: str
    formula: str
    per_gpu: float
    phase: str


def memory_rows(c: Mapping[str, Any], s: Setup) -> List[Row]:
    """The per-GPU memory of ``s`` on the model of ``c``, row by row (bytes), then the peak on the device.

    FSDP2 keeps each rank's shards (on the device, or in host memory with ``cpu_offload``) and gathers what it
    computes with: one decoder layer at a time in training (the root, embedding and output head, stays gathered:
    in fp32 under ``dtype: bf16``), and the whole model for a rollout, since the native engine samples from the
    live module (the recipe gathers once per rollout, not once per decoded token). The gathered copy is a new
    tensor even on one process, so it adds to the shards instead of replacing them.
    """
    p, d = parameter_counts(c), _dims(c)
    n, P, layer = s.gpus, p["total"], p["largest_layer"]
    root = p["embedding"] + p["head"] + d["H"]  # embedding, output head, final norm
    tokens = s.micro_batch * s.seq_len
    kept = "host" if s.cpu_offload else "static"  # where the shards live
    rows: List[Row] = []
    if s.lora_rank is None:
        rows += [Row("fp32 master weights", f"4 B x {P:,} / {n}", 4 * P / n, kept),
                 Row("AdamW moments (fp32)", f"8 B x {P:,} / {n}", 8 * P / n, kept),
                 Row("fp32 gradients (freed after the optimizer step)", f"4 B x {P:,} / {n}", 4 * P / n,
                     "host" if s.cpu_offload else "train")]
        if s.kl_reference:
            rows.append(Row("bf16 reference model", f"2 B x {P:,} / {n}", 2 * P / n, "static"))
        rows.append(Row("layer gradient, unsharded (bf16 + fp32 for the reduce-scatter)", f"6 B x {layer:,}",
                        6 * layer, "train"))
        root_bytes, root_text = 4, "fp32"
    else:
        a = lora_parameters(c, s.lora_targets, s.lora_rank)
        rows += [Row("bf16 frozen base weights", f"2 B x {P:,} / {n}", 2 * P / n, kept),
                 Row("adapters + gradients + AdamW (bf16)", f"8 B x {a:,} / {n}", 8 * a / n, kept)]
        root_bytes, root_text = 2, "bf16"
    rows.append(Row("bf16 layers gathered by FSDP2 (this one and the prefetched next)", f"2 x 2 B x {layer:,}",
                    4 * layer, "train"))
    rows.append(Row(f"embedding and output head gathered ({root_text})", f"{root_bytes} B x {root:,}",
                    root_bytes * root, "train"))
    per_layer = [layer_activation_elements(c, k, s.seq_len) for k in layer_types(c)]
    if s.activation_checkpointing:
        rows.append(Row("activations: each layer's bf16 input (checkpointed)",
                        f"{d['L']} x {tokens:,} tokens x {d['H']} x 2 B", d["L"] * tokens * d["H"] * 2, "train"))
        rows.append(Row("activations: one layer recomputed in the backward",
                        f"{tokens:,} tokens x {max(per_layer):,} x 2 B", tokens * max(per_layer) * 2, "train"))
    else:
        rows.append(Row("activations: every layer's saved tensors",
                        f"{tokens:,} tokens x {sum(per_layer):,} x 2 B", tokens * sum(per_layer) * 2, "train"))
    rows.append(Row("fp32 logits chunk and its gradient", f"2 x {s.chunk} x {d['V']:,} x 4 B", 8 * s.chunk * d["V"],
                    "train"))
    rows.append(Row(f"whole model gathered for the rollout (layers bf16, embedding and head {root_text})",
                    f"2 B x {P - root:,} + {root_bytes} B x {root:,}", 2 * (P - root) + root_bytes * root, "generate"))
    cache = _cache_bytes_per_row(c, s.seq_len)
    rows.append(Row("generation cache", f"{s.rows} rows x {cache:,} B", s.rows * cache, "generate"))
    static = sum(r.per_gpu for r in rows if r.phase == "static")
    train = sum(r.per_gpu for r in rows if r.phase == "train")
    gen = sum(r.per_gpu for r in rows if r.phase == "generate")
    host = sum(r.per_gpu for r in rows if r.phase == "host")
    if host:
        rows.append(Row("host memory per process (fsdp_cpu_offload)", "", host, "host total"))
    rows.append(Row("peak (static + the larger of training and generation)", "", static + max(train, gen), "peak"))
    return rows


def markdown(c: Mapping[str, Any], s: Setup) -> str:
    p = parameter_counts(c)
    head = "tied to the embedding" if c.get("tie_word_embeddings") else "its own"
    what = f"LoRA rank {s.lora_rank} on {', '.join(s.lora_targets)}" if s.lora_rank else "Full fine-tune"
    lines = [f"{c['model_type']}: {p['total']:,} parameters ({p['active']:,} active per token; experts "
             f"{p['experts']:,}; embedding {p['embedding']:,}, output head {head}); largest layer "
             f"{p['largest_layer']:,}.", "",
             f"{what} on {s.gpus} GPU(s), FSDP2{' with CPU offload' if s.cpu_offload else ''}; micro-batch "
             f"{s.micro_batch} x {s.seq_len} tokens, {s.rows} rows generated per GPU, activation checkpointing "
             f"{'on' if s.activation_checkpointing else 'off'}.", "",
             "| per GPU | formula | GB |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.formula} | {r.per_gpu / GB:.1f} |" for r in memory_rows(c, s)]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a model directory or its config.json")
    parser.add_argument("--hub", default=None,
                        help="a published config.json by directory name (tests/real_hf_configs.py)")
    parser.add_argument("--recipe-config", required=True, help="the shipped YAML config whose batch to use")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.hub:  # the published config.json files the tests keep (a clone only)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.real_hf_configs import FAMILY_HUB_CONFIGS

        c = language_fields(FAMILY_HUB_CONFIGS[args.hub], args.hub)
    elif args.config:
        c = read_config(args.config)
    else:
        parser.error("give a config.json (or a model directory), or --hub NAME")
    s = setup_from_recipe_config(args.recipe_config, args.gpus)
    if args.no_activation_checkpointing:
        s = dataclasses.replace(s, activation_checkpointing=False)
    print(markdown(c, s))
    if args.json:
        out = {"parameters": parameter_counts(c), "setup": dataclasses.asdict(s),
               "rows": [dataclasses.asdict(r) for r in memory_rows(c, s)]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
