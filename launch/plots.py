"""Plots of a run: reward, rollout-training mismatch, and what the learner did about it, over learner steps."""

from __future__ import annotations

from pathlib import Path


def plot_run(rows: list[dict], out: str | Path, title: str = "", evals: list[dict] = ()) -> Path:
    """``evals``: held-out evaluations (metrics.jsonl's ``kind: eval`` rows), drawn over the
    reward at the step of the version they evaluated, pass@1 with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    steps = [r["step"] for r in rows]
    fig, (ax_r, ax_k, ax_c) = plt.subplots(1, 3, figsize=(16, 4))
    ax_r.plot(steps, [r["reward_mean"] for r in rows], marker=".", label="reward (sampled)")
    window = max(1, len(rows) // 10)
    if window > 1:
        smooth = [sum(r["reward_mean"] for r in rows[max(0, i - window + 1): i + 1]) / len(rows[max(0, i - window + 1): i + 1])
                  for i in range(len(rows))]
        ax_r.plot(steps, smooth, label=f"moving mean ({window})")
    precisions = sorted({p for r in rows for p in r.get("reward_by_precision", {})})
    if len(precisions) > 1:  # a mixed fleet: each precision's reward and mismatch
        for p in precisions:
            have = [r for r in rows if p in r.get("reward_by_precision", {})]
            ax_r.plot([r["step"] for r in have], [r["reward_by_precision"][p] for r in have], alpha=0.7,
                      label=f"reward, {p} workers")
            ax_k.plot([r["step"] for r in have], [r["mismatch_by_precision"][p]["mismatch_kl"] for r in have],
                      alpha=0.7, label=f"KL, {p} workers")
    if any("quant_kl_vs_bf16" in r for r in rows):  # the learner's own view of the int8 policy
        have = [r for r in rows if "quant_kl_vs_bf16" in r]
        ax_k.plot([r["step"] for r in have], [r["quant_kl_vs_bf16"] for r in have], linestyle=":",
                  label="int8 vs bf16 KL (probe set)")
    if any(r.get("model_turns_mean", 1) > 1 for r in rows):  # multi-turn episodes (calculator: 1 + its calls)
        ax_r.plot(steps, [r.get("model_turns_mean", 1) - 1 for r in rows], linestyle="--",
                  label="model turns per episode - 1 (calculator: calls)")
    if evals:
        at = [e["version"] for e in evals]  # one version per step: the step that made it
        ax_r.errorbar(at, [e["pass_at_1"] for e in evals],
                      yerr=[[e["pass_at_1"] - e["pass_at_1_low"] for e in evals],
                            [e["pass_at_1_high"] - e["pass_at_1"] for e in evals]],
                      marker="s", capsize=3, label=f"held-out pass@1 ({evals[0]['dataset']})")
        if any(e.get("mean_at_k") is not None for e in evals):
            have = [e for e in evals if e.get("mean_at_k") is not None]
            ax_r.plot([e["version"] for e in have], [e["mean_at_k"] for e in have], marker="^", linestyle="--",
                      label=f"held-out mean@{have[0]['k']}")
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
    # seed 001's indicator, and the corrections' effect, next to the LR that reacts to it
    ax_c.plot(steps, [r.get("mismatch_log_ppl_abs_diff", 0) for r in rows], marker=".", label="|log ppl diff|")
    ax_c.plot(steps, [r.get("is_truncated_fraction", 0) + r.get("is_masked_fraction", 0) for r in rows],
              marker=".", label="IS truncated + masked fraction")
    ax_c.set_xlabel("learner step")
    ax_c.grid(alpha=0.3)
    ax_lr = ax_c.twinx()
    ax_lr.plot(steps, [r["learner_lr"] for r in rows], color="k", linestyle="--", label="LR (right)")
    ax_lr.set_ylabel("learning rate")
    _twin_legend(ax_c, ax_lr)
    if title:
        fig.suptitle(title)
    return _save(fig, out)


def _twin_legend(ax, twin, **kw) -> None:
    """One legend for an axis and its twin (a right-hand scale), on the first."""
    (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, **kw)


def _save(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def fleet_changed(rows: list[dict]) -> bool:
    """Whether the run's fleet changed size or was asked to (autoscaling, `rlpipe scale`)."""
    return len({(r.get("rollout_workers"), r.get("fleet_desired_workers")) for r in rows}) > 1


def plot_fleet(rows: list[dict], out: str | Path, title: str = "") -> Path:
    """The fleet over time: workers registered and desired (rlpipe/autoscale.py), and the two
    signals the rule reads, the learner's wait fraction and the workers' idle fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    t = [r["time"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.step(t, [r.get("rollout_workers", 0) for r in rows], where="post", label="workers registered")
    ax.step(t, [r.get("fleet_desired_workers", 0) for r in rows], where="post", linestyle="--",
            label="workers desired")
    ax.set_xlabel("seconds since the learner started")
    ax.set_ylabel("workers")
    ax.set_ylim(0, max(r.get("fleet_desired_workers", 0) for r in rows) + 1)
    ax.grid(alpha=0.3)
    ax_f = ax.twinx()
    have = [r for r in rows if "fleet_wait_fraction" in r]
    ax_f.plot([r["time"] for r in have], [r["fleet_wait_fraction"] for r in have], ".", color="tab:red",
              markersize=3, label="learner waiting (right)")
    ax_f.plot([r["time"] for r in have], [r["fleet_idle_fraction"] for r in have], ".", color="tab:green",
              markersize=3, label="workers idle (right)")
    ax_f.set_ylim(0, 1)
    ax_f.set_ylabel("fraction of time, over the rule's window")
    _twin_legend(ax, ax_f, loc="upper left")
    if title:
        ax.set_title(title)
    return _save(fig, out)
