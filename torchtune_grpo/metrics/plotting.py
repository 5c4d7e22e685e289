"""``tune-grpo plot OUTPUT_DIR``: one PNG with a run's reward, held-out accuracy, KL and response length.

Reads ``OUTPUT_DIR/metrics.jsonl`` (written by the GRPO recipes): training rows carry ``reward/mean``,
``kl`` and ``response_length/mean``; evaluation rows (step 0, every ``eval_every_n_steps``, the end) carry
``eval/accuracy``, ``eval/pass@k`` and ``eval/reward/mean``.
"""

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

__all__ = ["read_metrics", "plot_compare", "plot_run"]


def read_metrics(path: "str | Path") -> List[Dict[str, float]]:
    """The rows of a ``metrics.jsonl`` file (lines that are not JSON objects are skipped).

    Raises:
        FileNotFoundError: when the file does not exist (the message says what writes it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: expected the metrics.jsonl that a GRPO run writes to its output_dir"
        )
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _series(rows: List[Dict[str, float]], key: str) -> Tuple[List[float], List[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
            xs.append(row["step"])
            ys.append(float(value))
    return xs, ys


def _panel_note(rows: List[Dict[str, float]], keys: List[Tuple[str, str]]) -> Optional[str]:
    """A note for a panel whose curve says nothing: the recipe logs ``kl`` as 0 when it has no reference.

    Without a reference model (``kl_coef: 0``) no KL is computed and every logged value is exactly 0.0; a
    real KL to the initial policy is 0 at step 1 and positive after it.
    """
    if [key for key, _ in keys] == ["kl"] and all(y == 0.0 for y in _series(rows, "kl")[1]):
        return "no KL computed: no reference model (kl_coef: 0)"
    return None


def plot_run(output_dir: "str | Path", out: Optional["str | Path"] = None, title: Optional[str] = None) -> Path:
    """Write a 2 x 2 PNG: mean reward, held-out accuracy (and pass@k), KL, mean response length vs step.

    Args:
        output_dir (str | Path): a run's output directory (holding ``metrics.jsonl``), or the file itself.
        out (Optional[str | Path]): PNG to write. Default is None (``OUTPUT_DIR/training_curves.png``).
        title (Optional[str]): figure title. Default is None (the directory name).

    Returns:
        Path: the PNG written.

    Raises:
        FileNotFoundError: without ``metrics.jsonl``.
        ValueError: when it holds no plottable metric.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    metrics_file = output_dir if output_dir.is_file() else output_dir / "metrics.jsonl"
    rows = read_metrics(metrics_file)
    run_dir = metrics_file.parent
    out = Path(out) if out is not None else run_dir / "training_curves.png"

    pass_keys = sorted({k for row in rows for k in row if k.startswith("eval/pass@")})
    panels = [
        ("Reward", "mean reward", [("reward/mean", "train reward (mean)"),
                                                      ("eval/reward/mean", "held-out reward (greedy)")]),
        ("Held-out accuracy", "fraction correct", [("eval/accuracy", "greedy accuracy")]
         + [(k, k[len("eval/"):]) for k in pass_keys]),
        ("KL to the reference policy", "KL (per token)", [("kl", "kl")]),
        ("Response length", "tokens", [("response_length/mean", "train (mean)"),
                                       ("eval/response_length/mean", "held-out greedy (mean)")]),
    ]
    if not any(_series(rows, key)[0] for _, _, keys in panels for key, _ in keys):
        raise ValueError(f"{metrics_file} has no plottable metrics (reward/mean, eval/accuracy, kl, ...)")

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (panel_title, ylabel, keys) in zip(axes.flat, panels):
        note = _panel_note(rows, keys)  # a curve that would say nothing is replaced by a note
        drawn = False
        for key, label in keys if note is None else []:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, label=label)
                drawn = True
        if panel_title.startswith("Held-out") and drawn:
            ax.set_ylim(-0.02, 1.02)
        if not drawn:
            ax.text(0.5, 0.5, note or "not logged", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
        ax.set_title(panel_title)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    fig.suptitle(title or f"GRPO run: {run_dir.resolve().name}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_compare(
    arms: Dict[str, List["str | Path"]],
    panels: List[Tuple[str, str]],
    out: "str | Path",
    title: str = "",
) -> Path:
    """One PNG comparing several arms of an experiment, one panel per metric, every seed of every arm.

    Each arm gets one colour: a thin line per run (seed) and a thick line for the mean over its runs at
    the steps they share.

    Args:
        arms (Dict[str, List[str | Path]]): arm label -> the output directories of its runs.
        panels (List[Tuple[str, str]]): ``(metric key, panel title)`` per panel, left to right.
        out (str | Path): the PNG to write.
        title (str): the figure's title. Default is ``""``.

    Returns:
        Path: ``out``.

    Raises:
        ValueError: when a run logged none of the panels' metrics.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: [read_metrics(Path(d) / "metrics.jsonl") for d in dirs] for label, dirs in arms.items()}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, panel_title) in zip(axes[0], panels):
        for (label, rows_of_runs), colour in zip(runs.items(), colours):
            series = [dict(zip(*_series(rows, key))) for rows in rows_of_runs]
            if not any(series):
                raise ValueError(f"the runs of {label!r} logged no {key!r}")
            for s in series:
                ax.plot(list(s), list(s.values()), color=colour, alpha=0.3, linewidth=1)
            steps = sorted(set.intersection(*(set(s) for s in series)))
            ax.plot(steps, [sum(s[x] for s in series) / len(series) for x in steps], color=colour, linewidth=2.5,
                    label=f"{label} (mean of {len(series)})")
        ax.set_title(panel_title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
