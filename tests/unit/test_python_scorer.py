"""Python reward functions (`type: python`): results, components, fields, and every way a function can fail."""

from __future__ import annotations

import textwrap

import pytest

from rlfleet.workers.scorer.batch import Scoring
from rlfleet.workers.scorer.config import ExactMatch, PythonScorer
from rlfleet.workers.scorer.python import import_problems, source_problems, with_sources
from rlfleet.workers.spec import SpecError, parse_job

REWARDS = textwrap.dedent("""
    import math, os, signal, time

    def score(completion, answer, prompt, **fields):
        if completion == "raise":
            raise ValueError("no")
        if completion == "hang":
            time.sleep(60)
        if completion == "nan":
            return math.nan
        if completion == "inf":
            return -math.inf
        if completion == "text":
            return "1.0"
        if completion == "none":
            return None
        if completion == "bad-part":
            return {"a": 1.0, "b": "x"}
        if completion == "many-parts":
            return {f"part{i}": 0.0 for i in range(17)}
        if completion == "memory":
            return len(bytearray(2 ** 30))
        if completion == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if completion == "exit":
            raise SystemExit(3)
        return float(completion == answer)

    def parts(completion, answer, prompt, **fields):
        return {"correct": float(completion == answer), "short": -0.01 * len(completion)}

    def echo(completion, answer, prompt, **fields):
        return {"prompt": float(prompt == "Q"), "tests": float(sum(fields["tests"])), "level": fields["level"]}
""")


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def python(rewards, **fields) -> PythonScorer:
    return PythonScorer(path=str(rewards), source=rewards.read_text(), timeout_seconds=1.0, memory_mib=256, **fields)


@pytest.mark.parametrize("completion, reason", [
    ("raise", "raised"),
    ("hang", "timeout"),
    ("nan", "nonfinite"),
    ("inf", "nonfinite"),
    ("text", "wrong_type"),
    ("none", "wrong_type"),
    ("bad-part", "wrong_type"),
    ("many-parts", "wrong_type"),
    ("memory", "memory"),
    ("kill", "crashed"),
    ("exit", "raised"),
])
def test_a_failing_call_scores_zero_is_counted_by_reason_and_the_run_goes_on(rewards, completion, reason):
    with Scoring([python(rewards, weight=2.0), ExactMatch()]) as scoring:
        results = scoring.score([("7", "7"), (completion, "7"), ("7", "7")])
        assert [r.reward for r in results] == [3.0, 0.0, 3.0]
        assert results[1].errors == ["score"] and results[1].reasons == [reason]
        assert results[1].scores == {"score": 0.0, "exact_match": 0.0}
        assert scoring.failure_counts == {("score", reason): 1}
        assert scoring.error_counts == {"score": 1, "exact_match": 0}
        # Whatever happened to the child, the next batch is scored.
        assert [r.reward for r in scoring.score([("7", "7")])] == [3.0]


@pytest.mark.timeout(60)
def test_a_hung_call_stops_at_its_own_timeout_after_a_call_of_a_long_one(rewards):
    """Each item runs a scorer of a 10-minute timeout, then one that hangs with 1 s: the hang is stopped at its own
    second, not when the call before it would have run out (once, the parent waited on that stale deadline: here
    10 minutes an item; the own-task example lost 4 s a hang)."""
    with Scoring([python(rewards, function="parts").model_copy(update={"timeout_seconds": 600.0}),
                  python(rewards)]) as scoring:
        results = scoring.score([("7", "7"), ("hang", "7")])
    assert [r.reasons for r in results] == [[], ["timeout"]]


def test_components_sum_to_the_score_and_are_named(rewards):
    with Scoring([python(rewards, function="parts", weight=0.5)]) as scoring:
        [right, wrong] = scoring.score([("7", "7"), ("12", "7")])
    assert right.components == {"correct": 1.0, "short": pytest.approx(-0.01)}
    assert right.reward == pytest.approx(0.5 * 0.99) and right.scores["parts"] == pytest.approx(0.99)
    assert wrong.components == {"correct": 0.0, "short": pytest.approx(-0.02)}


def test_python_scorers_are_named_by_their_function_and_several_prefix_their_components(rewards):
    scorers = [python(rewards, function="parts"), python(rewards, function="parts"), python(rewards)]
    with Scoring(scorers) as scoring:
        [result] = scoring.score([("7", "7")])
    assert set(result.scores) == {"parts#0", "parts#1", "score"}
    assert set(result.components) == {"parts#0/correct", "parts#0/short", "parts#1/correct", "parts#1/short"}


def test_the_prompt_and_the_rows_fields_reach_the_function(rewards):
    with Scoring([python(rewards, function="echo")]) as scoring:
        [result] = scoring.score([("x", "y", "Q", {"tests": [1, 2], "level": 3})])
    assert result.components == {"prompt": 1.0, "tests": 3.0, "level": 3.0}


def test_a_pool_scores_a_batch_in_parts_and_in_order(rewards):
    items = [(str(i % 3), "1") for i in range(10)] + [("hang", "1")]
    with Scoring([python(rewards)], processes=3) as scoring:
        results = scoring.score(items)
    assert [r.reward for r in results] == [float(i % 3 == 1) for i in range(10)] + [0.0]
    assert results[-1].reasons == ["timeout"]


def test_the_file_is_read_into_source_or_refused_naming_the_field(rewards, tmp_path):
    job = parse_job({"metadata": {"name": "j"}, "spec": {"scorers": [
        {"type": "math_answer"}, {"type": "python", "path": str(rewards)},
        {"type": "python", "path": str(tmp_path / "gone.py")}]}})
    scorers, problems = with_sources(job.spec.scorers)
    assert scorers[1].source == REWARDS
    assert problems == [f"spec.scorers.2.path {str(tmp_path / 'gone.py')!r}: No such file or directory "
                        "(a relative path is taken from where rlfleet runs)"]


@pytest.mark.parametrize("source, function, expected", [
    (REWARDS, "missing", "spec.scorers.0.path: AttributeError: "),
    ("score = 3\n", "score", "spec.scorers.0.path: TypeError: 'score' in "),
    ("import no_such_module_here\n", "score", "spec.scorers.0.path: ModuleNotFoundError: "),
    ("def score(:\n", "score", "spec.scorers.0.path: SyntaxError: "),
    ("import os\nos._exit(0)\n", "score", "spec.scorers.0.path: "),
])
def test_a_function_that_does_not_load_is_refused(tmp_path, source, function, expected):
    path = tmp_path / "r.py"
    path.write_text(source)
    [problem] = import_problems([PythonScorer(path=str(path), source=source, function=function)])
    assert problem.startswith(expected)


def test_a_loadable_function_passes_both_checks(rewards):
    scorers = [python(rewards), PythonScorer(module="json", function="dumps")]
    assert import_problems(scorers) == [] and source_problems(scorers) == []


@pytest.mark.parametrize("source, expected", [
    (None, "spec.scorers.0.source: missing: the pods cannot read"),
    ("def score(:\n", "spec.scorers.0.source: does not parse: "),
    ("def other(c, a, p):\n    return 1\n", "spec.scorers.0.source: defines no 'score' at the top level: define"),
])
def test_the_operator_refuses_without_running_the_code(tmp_path, source, expected):
    sentinel = tmp_path / "ran"
    spec = PythonScorer(path="r.py", source=source and f"open({str(sentinel)!r}, 'w')\n{source}")
    [problem] = source_problems([spec])
    assert problem.startswith(expected)
    assert not sentinel.exists()


@pytest.mark.parametrize("scorer, field", [
    ({"type": "python"}, "spec.scorers.0: Value error, give exactly one of path"),
    ({"type": "python", "path": "a.py", "module": "a"}, "spec.scorers.0: Value error, give exactly one of path"),
    ({"type": "python", "module": "a", "source": "x"}, "spec.scorers.0: Value error, source is the content"),
    ({"type": "python", "path": "a.py", "source": "#" * (300 * 1024)}, "spec.scorers.0.source: Value error, 307200"),
    ({"type": "python", "module": "a b"}, "spec.scorers.0.module: String should match pattern"),
    ({"type": "python", "path": "a.py", "memoryMib": 1}, "spec.scorers.0.memoryMib: Input should be greater"),
])
def test_the_schema_refuses_what_cannot_work(scorer, field):
    with pytest.raises(SpecError) as refused:
        parse_job({"metadata": {"name": "j"}, "spec": {"scorers": [scorer]}})
    assert refused.value.problems[0].startswith(field)


def test_a_rows_fields_travel_from_the_rollout_through_the_score_request_to_the_function(rewards):
    from rlfleet.v1 import scorer_pb2
    from rlfleet.workers.controller.rollouts import Group, Rollout
    from rlfleet.workers.data.tasks import Example
    from rlfleet.workers.scorer.server import ScorerService
    from rlfleet.workers.scorer.stage import score_items

    job = parse_job({"metadata": {"name": "j"}, "spec": {"scorers": [
        {"type": "python", "path": str(rewards), "source": REWARDS, "function": "echo"}]}})
    example = Example(id="line-1", prompt="Q", answer="4", fields={"tests": [1, 2, 3], "level": 2})
    group = Group(0, example, [Rollout(sample_id="s0", prompt=0, prompt_ids=[1], answer="4")])
    service = ScorerService(job)
    try:
        reply = service.Score(scorer_pb2.ScoreRequest(job_id="j", items=score_items([group], lambda ids: "x")), None)
    finally:
        service.close()
    [score] = reply.scores
    assert dict(score.components) == {"prompt": 1.0, "tests": 6.0, "level": 2.0}
    assert dict(score.scorer_scores) == {"echo": 9.0} and score.reward == 9.0


def test_the_reply_budget_holds_a_score_of_every_failure_and_the_most_components():
    """score_calls plans its calls by this size (gRPC's message limit): a Score can never be larger."""
    from rlfleet.v1 import scorer_pb2
    from rlfleet.workers.scorer.python import MAX_COMPONENT_CHARS, MAX_COMPONENTS
    from rlfleet.workers.scorer.stage import SCORE_BYTES, score_bytes

    specs = [PythonScorer(module="m", function="f" * 256), PythonScorer(module="m", function="f" * 256),
             ExactMatch()]
    names = ["f" * 256 + "#0", "f" * 256 + "#1", "exact_match"]
    components = {f"{name}/{i:0{MAX_COMPONENT_CHARS}d}": -1e300 for name in names[:2] for i in range(MAX_COMPONENTS)}
    score = scorer_pb2.Score(sample_id="", reward=-1e30, errors=names, reasons=["out_of_range"] * 3,
                             scorer_scores={name: -1e300 for name in names}, components=components)
    assert score.ByteSize() <= SCORE_BYTES + sum(score_bytes(spec, name) for spec, name in zip(specs, names))
