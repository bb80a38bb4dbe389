"""Draw docs/img/architecture.png, the README's picture of how a search flows through distmis.

    .venv/bin/python docs/draw_architecture.py          # writes docs/img/architecture.png

Only matplotlib (a dependency of distmis) is needed; the figure is boxes and arrows, no data.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent / "img" / "architecture.png"

# (x centre, y centre, width, height, title, detail, colour)
BOXES = {
    "spec": (1.3, 3.2, 2.3, 1.4, "search spec", "YAML: data, model,\nsearch space,\nparallelism, tracking", "#e8eef7"),
    "head": (4.6, 3.2, 2.3, 1.4, "Ray head", "distmis run (local Ray)\nor distmis submit\n(Jobs API, token)", "#fdf1dc"),
    "tune": (7.9, 3.2, 2.3, 1.4, "Ray Tune trials", "many trials at once\n(experiment-parallel),\nsearched values each",
             "#e4f2e4"),
    "train": (7.9, 0.9, 2.3, 1.4, "Ray Train workers", "one trial over N workers:\ndata, sequence (ViT)\nor pipeline (U-Net)",
              "#e4f2e4"),
    "mlflow": (11.2, 3.2, 2.3, 1.4, "MLflow store", "a run per search and\nper trial: params,\ncurves, results table",
               "#f3e6f3"),
    "model": (14.5, 3.2, 2.3, 1.4, "registered model", "best trial, scored on\nthe test split:\nmodels:/NAME@best",
              "#f3e6f3"),
    "predict": (14.5, 0.9, 2.3, 1.4, "predictions", "distmis predict SCANS,\nor mlflow.pyfunc\nwithout distmis",
                "#e8eef7"),
}

ARROWS = [
    ("spec", "head", "validated"),
    ("head", "tune", "trials"),
    ("tune", "train", "a trial of\nN workers"),
    ("tune", "mlflow", "driver logs"),
    ("mlflow", "model", "register"),
    ("model", "predict", "load"),
]


def edge(name: str, towards: str) -> tuple[float, float]:
    """The point on box ``name``'s border facing box ``towards`` (left/right sides, or top/bottom when stacked)."""
    x, y, w, h = BOXES[name][:4]
    tx, ty = BOXES[towards][:2]
    if abs(tx - x) < 0.5:  # stacked vertically
        return x, y - h / 2 if ty < y else y + h / 2
    return (x + w / 2, y) if tx > x else (x - w / 2, y)


def main() -> None:
    fig, ax = plt.subplots(figsize=(15.8, 4.6), dpi=110)
    ax.set_xlim(0, 15.8)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    for x, y, w, h, title, detail, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.04,rounding_size=0.12",
                                    facecolor=colour, edgecolor="#444444", linewidth=1.2))
        ax.text(x, y + h / 2 - 0.22, title, ha="center", va="center", fontsize=11.5, fontweight="bold")
        ax.text(x, y - 0.12, detail, ha="center", va="center", fontsize=9, linespacing=1.25)
    for start, end, label in ARROWS:
        a, b = edge(start, end), edge(end, start)
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=16, linewidth=1.4, color="#333333"))
        if label and a[0] == b[0]:  # vertical: the label to the right of the arrow
            ax.text(a[0] + 0.12, (a[1] + b[1]) / 2, label, ha="left", va="center", fontsize=8.5, color="#333333",
                    linespacing=1.1)
        elif label:
            ax.text((a[0] + b[0]) / 2, a[1] + 0.1, label, ha="center", va="bottom", fontsize=8.5, color="#333333")
    ax.text(7.9, 4.35, "distmis: one spec, a hyperparameter search on Ray, every trial in MLflow, the best model "
            "served", ha="center", va="center", fontsize=12)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, bbox_inches="tight", facecolor="white")
    print(OUT)


if __name__ == "__main__":
    main()
