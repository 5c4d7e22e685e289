"""What a run imports: `make demo`'s environment has no transformers (and no vLLM), so the recipe on a
torchtune-built policy must neither need nor load them; each costs seconds of every `tune run`'s start-up."""

import subprocess
import sys

from tests.conftest import REPO

# Runs the demo's GRPO config for one step, in a fresh interpreter where importing transformers or vllm fails
# (a None entry in sys.modules makes `import x` raise ImportError), then checks neither got loaded.
_RUN = """
import runpy, sys
for name in ("transformers", "vllm"):
    sys.modules[name] = None
sys.argv = ["grpo_full_finetune_distributed", "--config", {config!r}, "output_dir={out}", "max_steps=1",
            "batch_size=2", "group_size=2", "validation.num_samples=4", "eval_every_n_steps=null",
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger", "metric_logger.log_dir={out}"]
try:
    runpy.run_module("grpo_full_finetune_distributed", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
loaded = sorted(n for n in ("transformers", "vllm") if sys.modules.get(n) is not None)
print("LOADED", loaded)
"""


def test_the_demo_recipe_runs_without_transformers_or_vllm(tmp_path):
    code = _RUN.format(config=str(REPO / "configs" / "tiny" / "demo_grpo.yaml"), out=tmp_path / "out")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "LOADED []" in proc.stdout
    assert (tmp_path / "out" / "step_1").is_dir()
