"""`rlfleet report` on a run directory with known spans: bubble ratios by hand, PNGs written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.workers.cli import main
from rlfleet.workers.report import write_report
from rlfleet.workers.report.runs import bubbles, load_run

PNG = b"\x89PNG\r\n\x1a\n"


def write_spans(run_dir: Path, worker: str, changes: list[tuple[float, str]]) -> None:
    lines = [{"t": changes[0][0], "event": "start", "pid": 1}] + [{"t": t, "state": s} for t, s in changes]
    path = run_dir / "spans" / f"{worker}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """Loop from t=1010 (trainer leaves `starting`) to t=1020 (its clean end); step 1 ends at 1018."""
    run = tmp_path / "sync"
    write_spans(run, "trainer-0", [(1000, "starting"), (1010, "waiting_for_rollouts"), (1012, "busy"),
                                   (1018, "waiting_for_rollouts"), (1019, "busy"), (1020, "end")])
    # Still generating when the run ended (killed, no "end" line): the state lasts to the loop's end.
    write_spans(run, "generator-0", [(1000, "starting"), (1005, "waiting_for_requests"), (1010, "busy"),
                                     (1012, "waiting_for_requests"), (1018, "busy")])
    write_spans(run, "scorer-0", [(1001, "starting"), (1002, "waiting_for_requests"), (1012, "busy"),
                                  (1013, "waiting_for_requests")])
    steps = [{"step": 1, "time": 1018.0, "reward_mean": 0.1, "max_staleness": 0, "step_seconds": 8.0,
              "tokens_generated": 300},
             {"step": 2, "time": 1020.0, "reward_mean": 0.3, "max_staleness": 0, "step_seconds": 2.0,
              "tokens_generated": 300}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return run


def test_bubble_ratios_over_the_loop_window(run_dir):
    run = load_run(run_dir)
    assert (run.start, run.end) == (1010, 1020)
    found = bubbles(run)
    assert found["trainer"].ratio == pytest.approx(3 / 10)
    assert found["trainer"].idle == {"waiting_for_rollouts": 3.0}
    assert found["generator"].ratio == pytest.approx(6 / 10)
    assert found["scorer"].ratio == pytest.approx(9 / 10)
    after_step_1 = bubbles(run, after=1018.0)
    assert (after_step_1["trainer"].ratio, after_step_1["generator"].ratio) == (0.5, 0.0)


def test_report_writes_pngs_and_a_summary(run_dir, tmp_path):
    out = tmp_path / "report"
    summary = write_report([run_dir], out)
    assert "2 steps in 10.0 s of loop" in summary
    assert "generator  0.60  0.00  (waiting_for_requests 0.60)" in summary
    assert "scorer     0.90  1.00" in summary
    assert "trainer    0.30  0.50  (waiting_for_rollouts 0.30)" in summary
    assert (out / "summary.txt").read_text() == summary
    for name in ("reward.png", "timeline.png"):
        assert (out / name).read_bytes()[:8] == PNG


def test_cli_puts_two_runs_side_by_side(run_dir, tmp_path, capsys):
    other = tmp_path / "async"
    other.mkdir()
    (other / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())  # no spans: still a report
    assert main(["report", str(run_dir), str(other), "--window", "0:5"]) == 0
    printed = capsys.readouterr().out
    assert "sync (" in printed and "async (" in printed and "no spans files" in printed
    assert (run_dir / "report" / "timeline.png").read_bytes()[:8] == PNG


def test_cli_refuses_a_directory_without_steps(tmp_path):
    with pytest.raises(SystemExit, match="no trainer steps"):
        main(["report", str(tmp_path)])


def with_evaluations(run_dir: Path, results: list[dict]) -> Path:
    """The run's two step records carrying held-out results (evaluation in the loop) of versions 0 and 2."""
    path = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**s, **r, "eval_policy_version": 2 * n}) + "\n"
                            for n, (s, r) in enumerate(zip(steps, results))))
    return run_dir


def test_the_summary_reads_held_out_accuracy_also_from_records_made_before_evaluations_had_a_reward(run_dir, tmp_path):
    results = [{"eval_accuracy": 0.2, "eval_correct": 2, "eval_total": 10},
               {"eval_accuracy": 0.6, "eval_correct": 6, "eval_total": 10}]
    summary = write_report([with_evaluations(run_dir, results)], tmp_path / "report")
    assert "held-out accuracy (greedy): 0.200 at version 0, 0.600 at version 2 (6/10), best 0.600 at version 2" \
        in summary


def test_the_summary_of_a_job_without_an_answer_grading_scorer_gives_its_held_out_reward(run_dir, tmp_path):
    results = [{"eval_reward_mean": 0.9, "eval_scorer/regex_format": 0.45, "eval_total": 10},
               {"eval_reward_mean": 0.5, "eval_scorer/regex_format": 0.25, "eval_total": 10}]
    summary = write_report([with_evaluations(run_dir, results)], tmp_path / "report")
    assert "held-out reward mean (greedy): 0.900 at version 0, 0.500 at version 2, best 0.900 at version 0" in summary
    assert "held-out reward at version 2: 0.500 (scorer/regex_format 0.250)" in summary
    assert (tmp_path / "report" / "reward.png").read_bytes().startswith(PNG)


def test_a_run_with_an_environment_reports_its_turns_tools_and_episodes(run_dir, tmp_path):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line, (turns, share, calls, errors) in zip(lines, [(1.0, 0.25, 4, 3), (2.5, 0.75, 10, 1)]):
        line |= {"turns_mean": turns, "tool_episode_share": share, "tool_calls": calls, "tool_errors": errors,
                 "tool_calls/calculator": calls, "tool_errors/calculator": errors, "environment_seconds_mean": 0.002,
                 "episodes_across_versions": 2, "episodes_drifted": 0, "episodes_restarted": 0,
                 "episodes_truncated": 1, "environment_errors": 0}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = write_report([run_dir], tmp_path / "report")
    assert "episodes: 1.00 -> 2.50 turns, a tool called in 0.25 -> 0.75 of them, environment 2.0 ms" in summary
    assert "tool calls: 14 (4 failed): calculator 14 (4 failed)" in summary
    assert "across versions 4, drifted 0, restarted 0, truncated 2, environment errors 0" in summary
