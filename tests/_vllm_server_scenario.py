"""The measurements of tests/test_vllm_server.py's engine tests, against one ``vllm serve`` process.

:func:`measure` runs in a process that tests/test_vllm_server.py forks from the tests' fork server (the server is
a process of its own either way, so the vLLM state that must not leak into the tests' process stays there): the
trainer's model is the shipped SFT-trained ``tiny_qwen2_arith``
(peaked distributions: greedy decoding has no near-ties), its engine a :class:`VLLMServerGenerator` that starts
its own server with the package's flags; the tests assert on the returned measurements.
"""

import copy
import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict

import torch

from tests._vllm_arith import arith_trainer, max_sampled_logprob_diff, nudge_weights
from tests.conftest import REPO
from torchtune_grpo.generation import NativeGenerator, VLLMServerError, VLLMServerGenerator, WeightSyncCheck
from torchtune_grpo.models.logprobs import sequence_logprobs
from torchtune_grpo.training.batch import pack_sequences


def measure(tmp: Path) -> Dict[str, Any]:
    """Start a server through :class:`VLLMServerGenerator`, measure it against the trainer's model, close it.

    Args:
        tmp (Path): the checkpointer's output and the server's log directory.

    Returns:
        Dict[str, Any]: greedy tokens of both engines, sampling records, probe differences before and after a
        sync, the in-flight update's per-version logprob differences, the foreign-version error, and the
        server's exit code after ``close``.
    """
    trainer = arith_trainer(REPO / "configs" / "tiny" / "vllm_grpo_cpu.yaml", tmp)
    asset, model, tokenizer, data = trainer.asset, trainer.model, trainer.tokenizer, trainer.data
    prompts, stop = trainer.prompts, trainer.stop
    out = {}

    engine = VLLMServerGenerator(model=asset, dtype="fp32", max_model_len=256, kv_cache_memory_gib=0.25,
                                 log_dir=str(tmp))
    try:
        check = WeightSyncCheck(probe_length=64)
        probe = check.probe(engine.vocab_size)

        def trainer_probe():
            with torch.no_grad():
                return sequence_logprobs(model, torch.tensor([probe])).logprobs[0]

        def max_sampled_diff(r):
            return max_sampled_logprob_diff(model, r, tokenizer.pad_id)

        kw = dict(group_size=2, max_new_tokens=24, pad_id=tokenizer.pad_id, stop_tokens=stop)
        out["greedy_server"] = engine.generate(None, prompts, temperature=0.0, **kw).response_ids
        out["greedy_native"] = NativeGenerator(temperature=0.0).generate(model, prompts, **kw).response_ids
        out["url"] = engine.server.url

        lengths = sorted(len(x) for x in out["greedy_server"])
        budget = lengths[len(lengths) // 2]  # some completions stop, some are cut
        kw = dict(group_size=4, max_new_tokens=budget, pad_id=tokenizer.pad_id, stop_tokens=stop, temperature=0.7)
        r = engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
        out["sampled"] = {
            "rows": len(r.response_ids), "truncated": r.truncated.tolist(),
            "ends": [x[-1] for x in r.response_ids], "lengths": [len(x) for x in r.response_ids],
            "logprob_lengths": [len(x) for x in r.logprobs], "budget": budget, "stop": stop,
            "max_logprob_diff": max_sampled_diff(r),
            "same_seed": engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw).response_ids
                         == r.response_ids,
            "other_seed": engine.generate(None, prompts, generator=torch.Generator().manual_seed(1), **kw).response_ids
                          == r.response_ids,
        }

        # Weight sync: move every trainer weight (the tied embedding too), then sync through vLLM's API.
        out["diff_from_files"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
        gen = nudge_weights(model)
        out["diff_stale"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
        engine.chunk_bytes = 200_000  # several update_weights calls per version
        out["loaded"] = engine.load_weights(model.state_dict().items())
        out["num_parameters"] = len(model.state_dict())
        out["diff_synced"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
        out["synced_sampled_diff"] = max_sampled_diff(
            engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw))
        out["weight_version"] = json.load(urllib.request.urlopen(engine.server.url + "/weight_info"))["weight_version"]
        out["staging_left"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"torchtune_grpo_{os.getpid()}_")]

        # A version sent while completions are generating (another thread): the server pauses, takes it, drops
        # the running requests' keys and values, and continues. Each token is labelled with the version that
        # sampled it, and its logprob must be that version's, given the completion so far (old weights before
        # the switch, new weights after, with no stale cache in between).
        old_model = copy.deepcopy(model)
        many = [data[i]["tokens"] for i in range(8)] * 4
        long_kw = dict(group_size=8, max_new_tokens=200, pad_id=tokenizer.pad_id, stop_tokens=[], temperature=1.0)
        # When the update lands depends on timing (256 completions of ~180 tokens take several seconds here): it
        # is sent sooner or later after the requests go out until some completion is caught in the middle.
        trace = []
        for attempt, delay in enumerate([0.5, 1.0, 0.2, 2.0, 0.05, 3.0]):
            # A new version, one perturbation away from the one the server holds.
            old_model.load_state_dict(model.state_dict())
            nudge_weights(model, gen)
            result = {}
            thread = threading.Thread(target=lambda: result.update(r=engine.generate(
                None, many, generator=torch.Generator().manual_seed(attempt), **long_kw)))
            before = engine.weight_version
            thread.start()
            time.sleep(delay)
            engine.load_weights(model.state_dict().items(), in_flight=True)
            thread.join()
            r = result["r"]
            trace.append([delay, sorted({str(sorted(set(v))) for v in r.token_versions})])
            if any(len(set(v)) > 1 for v in r.token_versions):
                break
        mixed = [v for v in r.token_versions if len(set(v)) > 1]

        def per_token_logprobs(m, r):
            tokens, mask = pack_sequences(r.prompt_ids, r.response_ids, tokenizer.pad_id)
            with torch.no_grad():
                lp = sequence_logprobs(m, tokens, temperature=1.0).logprobs
            rows = zip(r.prompt_ids, r.response_ids)
            return [lp[i, len(p) - 1 : len(p) - 1 + len(row)] for i, (p, row) in enumerate(rows)]

        new_lp, old_lp = per_token_logprobs(model, r), per_token_logprobs(old_model, r)
        diffs = {"old": 0.0, "new": 0.0}
        for i, versions in enumerate(r.token_versions):
            for t, v in enumerate(versions):
                side, reference = ("new", new_lp) if v == before + 1 else ("old", old_lp)
                diffs[side] = max(diffs[side], abs(reference[i][t].item() - r.logprobs[i][t]))
        out["in_flight"] = {
            "before": before, "after": engine.weight_version, "attempts": attempt + 1, "mixed_rows": len(mixed),
            "rows": len(r.token_versions), "monotone": all(v == sorted(v) for v in r.token_versions),
            "labels": sorted({x for v in r.token_versions for x in v}), "max_diff": diffs,
            "would_differ_with_old_weights": max(
                (abs(old_lp[i][t].item() - r.logprobs[i][t]) for i, vs in enumerate(r.token_versions)
                 for t, v in enumerate(vs) if v == before + 1), default=0.0),
            "probe_diff": check.measure(trainer_probe(), engine.prompt_logprobs(probe)),
            "trace": trace,
            "paused_after": json.load(urllib.request.urlopen(engine.server.url + "/is_paused")),
        }

        # Someone else moves the server to another version: the next rollout refuses its completions.
        engine.server.post("/update_weight_version", {"new_version": "99"})
        try:
            engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
            out["foreign_version_error"] = None
        except VLLMServerError as e:
            out["foreign_version_error"] = str(e)

        process = engine.server.process
        engine.close()
        out["server_exit_code"] = process.poll()
    finally:  # also when a measurement fails: no server outlives the module
        engine.close()
    return json.loads(json.dumps(out))  # plain lists and dicts, as the tests compare them
