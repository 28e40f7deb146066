"""The run report: JSON with held-out accuracy before/after and per-step history, plus a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Write ``report`` as JSON at ``path`` and a plot of reward and accuracy per step beside it (``.png``).

    Returns the plot's path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    png = path.with_suffix(".png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report.get("history", [])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in hist], [h["mean_reward"] for h in hist], label="train mean reward", marker=".")
    evals = [e for e in report.get("evals", []) if e.get("accuracy") is not None]
    if evals:
        ax.plot([e["policy_version"] for e in evals], [e["accuracy"] for e in evals], label="held-out greedy accuracy",
                marker="o")
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(report.get("title", "Flywheel run"))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
