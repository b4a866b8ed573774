"""The training plot: loss (train and validation) and the validation acceptance length."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    trained = [h for h in history if h["train_loss"] is not None]
    left.plot([h["step"] for h in trained], [h["train_loss"] for h in trained], "o-", label="train (mean since last)")
    left.plot(steps, [h["val_loss"] for h in history], "s-", label="validation")
    left.set_xlabel("step"), left.set_ylabel("loss"), left.legend(), left.grid(alpha=0.3)
    right.plot(steps, [h["val_acceptance_length"] for h in history], "o-", color="tab:green")
    right.set_xlabel("step"), right.set_ylabel("acceptance length (teacher-forced)"), right.grid(alpha=0.3)
    right.set_title("validation split")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)
