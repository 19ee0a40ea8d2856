"""Plots of a run: reward and rollout-training mismatch over learner steps."""

from __future__ import annotations

from pathlib import Path


def plot_run(rows: list[dict], out: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    steps = [r["step"] for r in rows]
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    ax_r.plot(steps, [r["reward_mean"] for r in rows], marker=".", label="reward (sampled)")
    window = max(1, len(rows) // 10)
    if window > 1:
        smooth = [sum(r["reward_mean"] for r in rows[max(0, i - window + 1): i + 1]) / len(rows[max(0, i - window + 1): i + 1])
                  for i in range(len(rows))]
        ax_r.plot(steps, smooth, label=f"moving mean ({window})")
    ax_r.set_xlabel("learner step")
    ax_r.set_ylabel("mean reward")
    ax_r.set_ylim(0, 1)
    ax_r.grid(alpha=0.3)
    ax_r.legend()
    ax_k.plot(steps, [r["mismatch_kl"] for r in rows], marker=".", label="KL(mu || pi) (k1)")
    ax_k.plot(steps, [r["mismatch_k3_kl"] for r in rows], marker=".", label="k3")
    ax_k.set_xlabel("learner step")
    ax_k.set_ylabel("mismatch KL per token")
    ax_k.grid(alpha=0.3)
    ax_k.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
