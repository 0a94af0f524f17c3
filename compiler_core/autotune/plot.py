"""Tuning curves: the best GFLOP/s a session has found for each task against its trials."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from compiler_core.errors import UserError


def plot_curves(states: Sequence, path: str | Path, title: str = "") -> Path:
    """Draw each task's best-so-far GFLOP/s after each of its trials (the log's records, in
    the order they were measured, then this session's) into an image at `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a build machine
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'kiln[plot]'") from None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for k, state in enumerate(states):
        if state.history:
            trials = range(1, len(state.history) + 1)
            ax.plot(trials, state.history, label=f"task {k}: {_short(state.task.workload)}")
    ax.set_xlabel("trials of the task")
    ax.set_ylabel("best GFLOP/s so far")
    ax.set_title(title or "tuning curves")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="x-small", loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _short(workload: str, width: int = 48) -> str:
    return workload if len(workload) <= width else workload[: width - 3] + "..."
