"""Rule-based scorers, and batch scoring with weights, error counts and per-scorer timeouts."""

from __future__ import annotations

import typing

import pytest

from rlfleet.workers.scorer.batch import Scoring
from rlfleet.workers.scorer.rules import (
    exact_match,
    final_number,
    math_answer,
    regex_format,
    scorer_for,
)
from rlfleet.workers.scorer.config import ExactMatch, MathAnswer, PythonScorer, RegexFormat, ScorerSpec

MATH = MathAnswer()


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("7", "7"),
        ("3+4=7", "7"),
        ("x = -3", "-3"),
        ("+5", "5"),
        ("It costs 2.50 dollars.", "2.5"),
        ("1,000,000 grains", "1000000"),
        ("3/4", "0.75"),
        ("0.3333333", "1/3"),  # within the relative tolerance of 1e-6
        ("so \\boxed{12} and then 5", "12"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{1{,}000}", "1000"),
        ("#### 1,234", "1234"),
        ("The answer is 42. Check: 6*7=42, and 5 more", "42"),
        ("Answer: 9", "9"),
        ("so 12 ... 72", "Natalia sold 48 + 24 = 72 clips.\n#### 72"),
        ("0", "0"),
        ("٤٢ is written 42", "42"),  # other scripts' digits are ignored, ASCII ones still read
    ],
)
def test_math_answer_correct(completion, answer):
    assert math_answer(completion, answer, MATH) == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("6", "7"),
        ("7, no wait, 8", "7"),
        ("-7", "7"),
        ("0.333", "1/3"),
        ("\\boxed{8} though 7 is tempting", "7"),
        ("#### 5\n\nP.S. 7", "7"),
        ("no number here", "7"),
        ("7", "no number here"),
        ("1,2345", "12345"),
        ("1.5e3", "1500"),
        ("1.5e3", "1.5"),
    ],
)
def test_math_answer_incorrect(completion, answer):
    assert math_answer(completion, answer, MATH) == 0.0


@pytest.mark.parametrize(
    "text", ["1e999", "-1e999", "inf", "-inf", "nan", "NaN", "Infinity", "\\boxed{inf}", "1/0"]
)
def test_non_finite_numbers_equal_nothing(text):
    assert final_number(text) is None
    assert math_answer(text, text, MATH) == 0.0
    assert math_answer(text, "999", MATH) == 0.0


@pytest.mark.parametrize(
    "completion, answer",
    [("٤٢", "42"), ("４２", "42"), ("٤٢", "٤٢"), ("4٢", "4"), ("the answer is ４２", "42")],
)
def test_unicode_digits_are_not_numbers(completion, answer):
    assert math_answer(completion, answer, MATH) == 0.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("word " * 20_000 + "the answer is 9", "9", 1.0),
        ("1," * 50_000 + "7", "7", 1.0),
        ("(" * 100_000 + "5", "5", 1.0),
        ("-" * 100_000 + "5", "-5", 1.0),
        ("\\boxed{" * 15_000 + "3", "3", 1.0),
        ("answer " * 15_000 + "is 3", "3", 1.0),
        (",123" * 25_000 + "x", "123", 0.0),
        ("1e1 " * 25_000, "1", 0.0),
        ("7 " + "9" * 100_000, "7", 1.0),  # a 100k-digit numeral is not an answer
        ("1" * 100_000, "1", 0.0),
    ],
)
def test_100_kb_of_text(completion, answer, expected):
    assert math_answer(completion, answer, MATH) == expected


@pytest.mark.parametrize("completion", ["", " ", "\n\t  \n"])
def test_empty_completions_score_zero(completion):
    assert math_answer(completion, "7", MATH) == 0.0
    assert exact_match(completion, "7", ExactMatch()) == 0.0
    assert regex_format(completion, "7", RegexFormat(pattern=r"\d+")) == 0.0


def test_exact_match_strips_and_is_case_sensitive():
    spec = ExactMatch()
    assert exact_match(" Paris\n", "Paris ", spec) == 1.0
    assert exact_match("paris", "Paris", spec) == 0.0
    assert exact_match("Paris, France", "Paris", spec) == 0.0


def test_regex_format_fully_matches_the_stripped_completion():
    spec = RegexFormat(pattern=r"(?s)<think>.*</think>\s*-?\d+")
    assert regex_format("  <think>a\nb</think> 42\n", "", spec) == 1.0
    assert regex_format("<think>a</think> 42 and more", "", spec) == 0.0
    assert regex_format("42", "", spec) == 0.0


def test_scorer_for_picks_by_type():
    assert scorer_for(MathAnswer()) is math_answer
    assert scorer_for(ExactMatch()) is exact_match
    assert scorer_for(RegexFormat(pattern="x")) is regex_format


def test_reward_is_the_weighted_sum():
    boxed = RegexFormat(pattern=r"\\boxed\{\d+\}", weight=0.5)
    specs = [MathAnswer(weight=2.0), boxed, ExactMatch(weight=-1.0)]
    with Scoring(specs) as scoring:
        results = scoring.score([("\\boxed{4}", "4"), ("4", "4"), ("5", "4")])
    assert [r.reward for r in results] == [2.5, 1.0, 0.0]
    assert all(r.errors == [] for r in results)


def test_a_raising_scorer_scores_zero_and_is_counted():
    with Scoring([MathAnswer(), ExactMatch()]) as scoring:
        # A non-string completion makes both scorers raise inside the child.
        results = scoring.score([("7", "7"), (None, "7"), ("7", "7")])
        assert [r.reward for r in results] == [2.0, 0.0, 2.0]
        assert [r.errors for r in results] == [[], ["math_answer", "exact_match"], []]
        assert scoring.error_counts == {"math_answer": 1, "exact_match": 1}


def test_a_hanging_scorer_is_killed_and_only_its_call_scores_zero():
    # (a+)+$ backtracks exponentially on a run of a's that is not followed by the end.
    specs = [RegexFormat(pattern=r"(a+)+$", timeout_seconds=0.5), MathAnswer(weight=2.0, timeout_seconds=0.5)]
    items = [("aaaa", "1"), ("a" * 40 + "b 2", "2"), ("aa", "3"), ("a" * 40 + " 4", "4"), ("aaa 5", "5")]
    with Scoring(specs) as scoring:
        results = scoring.score(items)
        assert [r.reward for r in results] == [1.0, 2.0, 1.0, 2.0, 2.0]
        assert [r.errors for r in results] == [[], ["regex_format"], [], ["regex_format"], []]
        assert scoring.error_counts == {"regex_format": 2, "math_answer": 0}
        # The restarted child keeps serving later batches.
        assert [r.reward for r in scoring.score([("aa 7", "7")])] == [2.0]


def test_repeated_scorer_types_get_distinct_names():
    with Scoring([ExactMatch(), ExactMatch(weight=0.5)]) as scoring:
        results = scoring.score([(None, "x")])
        assert results[0].errors == ["exact_match#0", "exact_match#1"]


# Completions that would leave a file behind if any scorer ran them as Python or as a shell command.
ATTACKS = [
    "__import__('pathlib').Path({p!r}).touch()",
    "exec(\"open({p!r}, 'w').close()\")",
    "$(touch {p})",
    "`touch {p}`; 42",
    "{{{{ ''.__class__.__mro__[1].__subclasses__() }}}} eval('open({p!r}, \"w\")')",
]


def test_no_scorer_runs_a_completion_as_code(tmp_path):
    """Every scorer type the job schema offers (none is a sandboxed code runner) treats completions as text; a
    python scorer runs the job's own code, which gets the completion as a string (tests/unit/test_python_scorer.py)."""
    sentinel = tmp_path / "executed"
    kinds = [kind for kind in typing.get_args(typing.get_args(ScorerSpec)[0]) if kind is not PythonScorer]
    specs = [kind(pattern=".*") if kind is RegexFormat else kind() for kind in kinds]
    with Scoring(specs) as scoring:
        scores = scoring.score([(attack.format(p=str(sentinel)), "42") for attack in ATTACKS])
    assert len(scores) == len(ATTACKS)
    assert not sentinel.exists(), "a scorer executed a completion"
