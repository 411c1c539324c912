"""`rlfleet report RUN_DIR...`: PNGs and a text summary of one run, or of several side by side."""

from __future__ import annotations

from pathlib import Path


def write_report(run_dirs: list[Path], out_dir: Path, window: tuple[float, float] | None = None) -> str:
    """Write reward.png, timeline.png and summary.txt into out_dir; returns the summary."""
    from rlfleet.workers.report.plots import plot_progress, plot_timeline
    from rlfleet.workers.report.runs import load_run
    from rlfleet.workers.report.summary import summarize

    runs = [load_run(path) for path in run_dirs]
    missing = [str(run.path) for run in runs if not run.steps]
    if missing:
        raise FileNotFoundError(f"no trainer steps in {', '.join(missing)} (metrics.jsonl missing or empty)")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_progress(runs, out_dir / "reward.png")
    plot_timeline(runs, out_dir / "timeline.png", window)
    summary = "\n\n".join(summarize(run) for run in runs) + "\n"
    (out_dir / "summary.txt").write_text(summary)
    return summary
