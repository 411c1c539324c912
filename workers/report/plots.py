"""PNGs of one or more runs: reward and staleness over steps, and each worker's busy/idle timeline.

Several runs share one figure (a sync and an async run side by side) with a common time axis, so
the bubbles of the two schedules can be compared at a glance, like the LlamaRL paper's figures.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

from rlfleet.workers.metrics.clock import BUSY  # noqa: E402
from rlfleet.workers.report.runs import Run, evaluations, held_out_key  # noqa: E402

STATE_COLORS = {
    BUSY: "#2ca02c",
    "waiting_for_requests": "#d9d9d9",
    "waiting_for_rollouts": "#ff7f0e",
    "waiting_for_weights": "#d62728",
    "receiving_weights": "#9467bd",
    "loading_weights": "#e377c2",
    "checkpointing": "#8c564b",
    "waiting_for_rank0": "#aec7e8",
    "bookkeeping": "#ffdd57",
    "waiting_for_eval": "#bcbd22",
    "starting": "#7f7f7f",
}
OTHER_COLOR = "#17becf"
ROLE_ORDER = ("trainer", "generator", "scorer")


def plot_progress(runs: list[Run], path: Path) -> None:
    """Reward over steps and over loop time, held-out accuracy or mean reward (evaluation in the loop), and the
    staleness of each step's oldest trained sample."""
    fig, (reward, by_time, held_out, staleness) = plt.subplots(4, 1, figsize=(9, 12), constrained_layout=True)
    for run in runs:
        steps = [r["step"] for r in run.steps]
        rewards = [r["reward_mean"] for r in run.steps]
        reward.plot(steps, rewards, label=run.name, linewidth=1.2)
        by_time.plot(list(itertools.accumulate(r["step_seconds"] for r in run.steps)), rewards, label=run.name,
                     linewidth=1.2)
        scored = evaluations(run)
        key = held_out_key(scored)
        held_out.plot([r["eval_policy_version"] for r in scored], [r[key] for r in scored], marker="o",
                      label=run.name if key == "eval_accuracy" else f"{run.name} (mean reward)", linewidth=1.2)
        staleness.step(steps, [r["max_staleness"] for r in run.steps], where="mid", label=run.name)
    reward.set(title="Mean reward per step", xlabel="trainer step", ylabel="reward")
    by_time.set(title="Mean reward over wall time", xlabel="seconds since the first step began", ylabel="reward")
    held_out.set(title="Held-out accuracy, greedy (evaluation in the loop; the mean reward where no scorer grades "
                 "answers)", xlabel="policy version scored", ylabel="accuracy")
    staleness.set(title="Staleness of the step's oldest trained sample", xlabel="trainer step",
                  ylabel="policy versions")
    staleness.yaxis.get_major_locator().set_params(integer=True)
    for axes in (reward, by_time, held_out, staleness):
        axes.grid(alpha=0.3)
        axes.legend(loc="best", fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(runs: list[Run], path: Path, window: tuple[float, float] | None = None) -> None:
    """One panel per run, one lane per worker: busy in green, idle coloured by reason.

    `window` = (from, to) in seconds since each run's loop start; by default the longest loop."""
    lanes = [sorted(run.spans, key=_lane_order) for run in runs]
    heights = [max(1, len(lane)) for lane in lanes]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.2 + 0.55 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, constrained_layout=True)
    limit = window or (0.0, max((run.seconds for run in runs), default=1.0))
    seen: set[str] = set()
    for ax, run, workers in zip(axes[:, 0], runs, lanes):
        for row, worker in enumerate(workers):
            for state, spans in _by_state(run, worker).items():
                seen.add(state)
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=STATE_COLORS.get(state, OTHER_COLOR),
                               linewidth=0)
        ax.set_yticks(range(len(workers)), [f"{role}-{rank}" for role, rank in workers])
        ax.set_ylim(max(1, len(workers)) - 0.5, -0.5)
        if not workers:
            ax.text(0.5, 0.5, "no spans files in this run", transform=ax.transAxes, ha="center", va="center")
        ax.set_xlim(*limit)
        ax.set_title(f"{run.name}: busy and idle time of each worker")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the training loop started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=STATE_COLORS.get(s, OTHER_COLOR)) for s in _legend_order(seen)]
    fig.legend(handles, _legend_order(seen), loc="outside lower center", ncol=5, fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _by_state(run: Run, worker: tuple[str, int]) -> dict[str, list[tuple[float, float]]]:
    """(start, width) bars per state, in seconds since the loop start."""
    bars: dict[str, list[tuple[float, float]]] = {}
    for span in run.spans[worker]:
        bars.setdefault(span.state, []).append((span.start - run.start, span.end - span.start))
    return bars


def _lane_order(worker: tuple[str, int]) -> tuple[int, int]:
    role, rank = worker
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), rank)


def _legend_order(states: set[str]) -> list[str]:
    known = [s for s in STATE_COLORS if s in states]
    return known + sorted(states - set(known))
