"""`specray bench --plot FILE.png`: tok/s against batch size for plain and speculative
decoding, and the per-position acceptance rate of the speculative run (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path


def plot_sweeps(path: str | Path, plain_rows: list[dict], spec_rows: list[dict] | None, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if spec_rows else 1, figsize=(11 if spec_rows else 6, 4), squeeze=False)
    ax = axes[0][0]
    for rows, label in ((plain_rows, "plain"), (spec_rows, "speculative")):
        if rows:
            ax.plot([r["batch"] for r in rows], [r["total_tok_s"] for r in rows], "-o", label=label)
    ax.set(xlabel="batch size", ylabel="total tok/s", title=f"{title} throughput", xscale="log")
    ax.set_xticks([r["batch"] for r in plain_rows], [str(r["batch"]) for r in plain_rows])
    ax.legend()
    if spec_rows:
        ax = axes[0][1]
        for r in spec_rows:
            rates = r.get("acceptance_per_position", [])
            ax.plot(range(1, len(rates) + 1), rates, "-o", label=f"batch {r['batch']}")
        ax.set(xlabel="draft position", ylabel="acceptance rate", title="per-position acceptance", ylim=(0, 1.05))
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
