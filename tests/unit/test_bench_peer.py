"""`rlfleet bench peer`'s pure parts: the jobs it runs, the curves it reads, the comparison it prints, TRL's clock."""

from __future__ import annotations

import argparse
import json

import pytest

from rlfleet.benchmarks import peer, peer_trl
from rlfleet.workers.spec import parse_job


@pytest.mark.parametrize("model", sorted(peer.MODELS))
@pytest.mark.parametrize("task", sorted(peer.TASKS))
def test_every_task_is_a_valid_job_that_names_only_what_a_user_must(task, model):
    data = peer.task_job(task, model, limit=50, eval_every=5)
    job = parse_job(data)
    assert set(data["spec"]) == {"model", "data", "scorers", "generation", "algorithm", "checkpoint", "evaluation"}
    # What the bench sets beyond the task is how long and how it measures, never how it learns.
    assert data["spec"]["algorithm"] == {"steps": 10**6} and set(data["spec"]["generation"]) == {"maxNewTokens"}
    assert job.spec.evaluation.limit == 50 and job.spec.data.held_out == 50


def test_rlfleet_curve_puts_each_evaluated_version_at_the_time_its_weights_were_trained():
    started = 1000.0
    records = [{"policy_version": 1, "time": 1010.0, "samples_trained": 64, "eval_accuracy": 0.1,
                "eval_policy_version": 0},
               {"policy_version": 2, "time": 1020.0, "samples_trained": 64},
               {"policy_version": 3, "time": 1030.0, "samples_trained": 60, "eval_accuracy": 0.3,
                "eval_policy_version": 2},
               {"policy_version": 4, "time": 1050.0, "samples_trained": 64, "eval_accuracy": 0.5,
                "eval_policy_version": 4}]
    curve = peer.rlfleet_curve(records, started, seconds=40.0)
    assert curve.points == [(0.0, 0.1), (20.0, 0.3)]  # version 4 was trained after the wall time
    assert curve.samples == 188


def test_rlfleet_curve_leaves_its_evaluations_out_of_its_clock_as_trls_is():
    # Version 0's evaluation took 6 s of the generator while version 1 trained, version 2's 4 s while 3 trained.
    records = [{"policy_version": 1, "time": 1016.0, "samples_trained": 64, "eval_accuracy": 0.1,
                "eval_policy_version": 0, "eval_seconds": 6.0},
               {"policy_version": 2, "time": 1026.0, "samples_trained": 64},
               {"policy_version": 3, "time": 1040.0, "samples_trained": 64, "eval_accuracy": 0.3,
                "eval_policy_version": 2, "eval_seconds": 4.0},
               {"policy_version": 4, "time": 1049.0, "samples_trained": 64}]
    curve = peer.rlfleet_curve(records, 1000.0, seconds=40.0)
    assert curve.points == [(0.0, 0.1), (20.0, 0.3)]
    assert curve.samples == 256  # version 4 at 39 s of training time, 49 of wall time


def test_a_curve_reads_the_newest_evaluation_at_or_before_a_time_and_when_it_first_reaches_a_value():
    curve = peer.Curve("x", [(0.0, 0.1), (10.0, 0.4), (20.0, 0.3), (30.0, 0.5)])
    assert [curve.at(t) for t in (5.0, 10.0, 25.0, 99.0)] == [0.1, 0.4, 0.3, 0.5]
    assert curve.reaches(0.35) == 10.0 and curve.reaches(0.5) == 30.0 and curve.reaches(0.6) is None


def test_compare_holds_every_curve_at_each_mark_and_each_of_ours_time_to_their_final_accuracy():
    ours = peer.Curve("RLFleet", [(0.0, 0.2), (25.0, 0.4), (55.0, 0.5)], samples=900)
    theirs = peer.Curve("TRL", [(31.0, 0.25), (62.0, 0.4)], samples=300)
    result = peer.compare("arith99", 0.2, [ours], theirs, seconds=60.0, marks=2)
    assert result["grid"] == [30.0, 60.0]
    assert result["rows"] == {"RLFleet": [0.4, 0.5], "TRL": [0.2, 0.25]}  # TRL's 62 s point is after 60 s
    assert result["their_final"] == (62.0, 0.4)
    assert result["targets"]["RLFleet"] == {"at_or_above": True, "reach_seconds": 25.0,
                                            "time_ratio": pytest.approx(25.0 / 62.0)}
    text = peer.markdown([result], "s")
    assert "| RLFleet | 0.400 | 0.500 |" in text and "| TRL | 0.200 | 0.250 |" in text
    assert "RLFleet reaches it at 25 s (0.40 of TRL's time); at or above TRL at every mark: yes." in text
    assert "samples trained: RLFleet 900, TRL 300" in text and "in-loop evaluation: RLFleet 0.200;" in text


def test_compare_says_for_each_variant_when_it_is_below_them_or_never_reaches_them():
    ours = [peer.Curve("RLFleet", [(0.0, 0.2), (25.0, 0.45)]), peer.Curve("lr3e-5", [(0.0, 0.2), (40.0, 0.3)])]
    theirs = peer.Curve("TRL", [(30.0, 0.35), (60.0, 0.4)])
    result = peer.compare("t", 0.2, ours, theirs, seconds=60.0, marks=2)
    assert result["targets"]["lr3e-5"] == {"at_or_above": False, "reach_seconds": None, "time_ratio": None}
    assert result["targets"]["RLFleet"]["at_or_above"] and list(result["rows"]) == ["RLFleet", "lr3e-5", "TRL"]
    text = peer.markdown([result], "s")
    assert "lr3e-5 reaches it never; at or above TRL at every mark: no." in text


def test_a_variant_is_spec_fields_over_the_defaults_and_a_bad_one_is_refused_before_any_run():
    name, settings = peer.variant('lr3e-5={"algorithm": {"learningRate": 3e-5}, "generation": {"temperature": 0.8}}')
    job = parse_job(peer.task_job("arith99", "tiny", limit=10, eval_every=5, settings=settings))
    assert name == "lr3e-5" and job.spec.algorithm.learning_rate == 3e-5 and job.spec.generation.temperature == 0.8
    assert job.spec.algorithm.steps == 10**6 and job.spec.generation.max_new_tokens == 16  # the rest kept
    for bad in ("trl={}", "Upper={}", "x=[1]", "x={not json"):
        with pytest.raises(argparse.ArgumentTypeError):
            peer.variant(bad)
    with pytest.raises(SystemExit):
        peer.main(["--rlfleet", "a={}", "--rlfleet", "a={}"])


def test_trl_saves_at_every_mark_passed_with_its_clock_stopped_while_saving(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(peer_trl.time, "time", lambda: now[0])
    saved = []

    def save(directory):
        saved.append(directory.name)
        now[0] += 5.0  # saving takes five seconds, which training time does not count

    budget = peer_trl.TimeBudget(started=100.0, marks=[10.0, 20.0, 30.0], out=tmp_path, save=save)
    now[0] = 112.0
    assert not budget.after_step(3, 48) and saved == ["at-000010"]
    now[0] = 140.0  # 35 s of training time: two marks passed in one step
    assert budget.after_step(7, 112) and saved == ["at-000010", "at-000020", "at-000030"]
    marks = [json.loads(line) for line in (tmp_path / peer_trl.MARKS_FILE).read_text().splitlines()]
    assert [(m["mark"], m["elapsed"], m["step"]) for m in marks] == [(10.0, 12.0, 3), (20.0, 35.0, 7),
                                                                     (30.0, 35.0, 7)]
    assert budget.elapsed() == pytest.approx(140.0 + 10.0 - 100.0 - 15.0)


def test_trl_runs_with_its_defaults_save_the_task_and_the_cpu_then_what_the_bench_is_told(tmp_path):
    job = parse_job(peer.task_job("arith99", "tiny", limit=10, eval_every=5))
    config = peer_trl.grpo_config(job, tmp_path, {"learning_rate": 3e-6})
    assert config.max_completion_length == 16 and config.use_cpu and not config.bf16
    assert config.learning_rate == 3e-6 and config.num_generations == 8  # TRL's own default group size
