"""MATH-style answers: math_verify grades them as a MATH grader does, math_answer never passes one a MATH grader
fails."""

from __future__ import annotations

import pytest
from bad_jobs import job

from rlfleet.workers.scorer.batch import Scoring
from rlfleet.workers.scorer.config import MathAnswer, MathVerify
from rlfleet.workers.scorer.latex import math_verify, reference_latex
from rlfleet.workers.scorer import rules
from rlfleet.workers.scorer.rules import math_answer, scorer_for
from rlfleet.workers.spec import parse_job

# (reference as MATH stores it, completion, the grade a MATH grader gives: 1 when the final answers are equal)
MATH_CASES = [
    ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{1}{2}}$.", 1),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1),
    ("\\frac{1}{2}", "So $x = \\frac{3}{2}$.", 0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{4}}", 0),
    ("\\frac{3}{4}", "\\boxed{\\dfrac34}", 1),
    ("0.75", "\\boxed{\\frac{3}{4}}", 1),
    ("-\\frac{1}{3}", "\\boxed{-\\frac13}", 1),
    ("\\frac{3}{2}", "So $x = \\frac{3}{2}$.", 1),
    ("2\\sqrt{2}", "\\boxed{2\\sqrt{3}}", 0),
    ("2\\sqrt{2}", "\\boxed{2\\sqrt{2}}", 1),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", 1),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1),
    ("\\sqrt{3}", "\\boxed{3}", 0),
    ("3", "\\boxed{\\sqrt{3}}", 0),
    ("3", "\\boxed{3\\pi}", 0),
    ("3\\pi", "\\boxed{3\\pi}", 1),
    ("\\pi", "\\boxed{3.14}", 0),
    ("5", "\\boxed{5\\sqrt{2}}", 0),
    ("12", "\\boxed{x^{12}}", 0),
    ("2", "The roots give $x^2$.", 0),
    ("12", "The answer is \\boxed{12}.", 1),
    ("12", "\\boxed{13}", 0),
    ("4", "2 + 2 = \\boxed{4}", 1),
    ("3", "\\boxed{\\frac{9}{3}}", 1),
    ("1000", "\\boxed{1{,}000}", 1),
    ("[1,2)", "\\boxed{[1,2)}", 1),
    ("[1,2)", "\\boxed{(1,2)}", 0),
    ("(-\\infty, 3]", "\\boxed{(-\\infty,3]}", 1),
    ("(-\\infty, 3]", "\\boxed{(-\\infty,3)}", 0),
    ("\\{1,2,3\\}", "\\boxed{\\{3,2,1\\}}", 1),
    ("\\{1,2,3\\}", "\\boxed{\\{1,2\\}}", 0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1),
    ("x^2+2x+1", "\\boxed{x^2+1}", 0),
    ("e^2", "\\boxed{e^{2}}", 1),
    ("\\frac{1}{2}", "I could not solve it.", 0),
]


@pytest.mark.parametrize("reference, completion, grade", MATH_CASES)
def test_math_verify_grades_as_a_math_grader(reference, completion, grade):
    assert math_verify(completion, reference, MathVerify()) == grade


@pytest.mark.parametrize("reference, completion, grade", MATH_CASES)
def test_math_answer_never_passes_what_a_math_grader_fails(reference, completion, grade):
    """It may fail a right answer it cannot read (a LaTeX reference, a box holding more than a number): by design."""
    assert math_answer(completion, reference, MathAnswer()) <= grade


@pytest.mark.parametrize(
    "reference, completion",
    [("\\frac{1}{2}", "\\boxed{0.5}"), ("0.75", "\\boxed{\\frac{3}{4}}"), ("3", "\\boxed{\\frac{9}{3}}"),
     ("12", "The answer is \\boxed{12}."), ("1000", "\\boxed{1{,}000}"), ("\\frac{3}{2}", "So $x = \\frac{3}{2}$.")],
)
def test_math_answer_still_reads_numbers_written_in_latex(reference, completion):
    assert math_answer(completion, reference, MathAnswer()) == 1.0


@pytest.mark.parametrize("reference", ["2\\sqrt{2}", "3\\pi", "x^2+2x+1", "[1,2)", "\\{1,2,3\\}", "\\sqrt{3}",
                                       "\\boxed{2\\sqrt{2}}", "#### 3\\pi", "e^2"])
def test_a_reference_that_is_not_a_plain_number_is_not_read(reference):
    assert rules.reference_number(reference) is None
    assert math_answer(reference, reference, MathAnswer()) == 0.0


@pytest.mark.parametrize(
    "answer, latex",
    [("\\frac{1}{2}", "$\\frac{1}{2}$"), ("$x^2$", "$x^2$"), ("\\boxed{3}", "\\boxed{3}"),
     ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "$72$")],
)
def test_reference_latex(answer, latex):
    assert reference_latex(answer) == latex


def test_a_hanging_math_verify_call_scores_zero_is_counted_and_its_child_replaced():
    # sympy expands a power tower of this height for minutes; the scorer's timeout cuts it short.
    hang = "\\boxed{" + "2^{" * 12 + "9" + "}" * 13
    specs = [MathVerify(timeout_seconds=1.0), MathAnswer()]
    with Scoring(specs) as scoring:
        results = scoring.score([("\\boxed{\\frac{1}{2}}", "0.5"), (hang, "2"), ("\\boxed{2}", "2")])
        assert [r.reward for r in results] == [2.0, 0.0, 2.0]
        assert [r.errors for r in results] == [[], ["math_verify"], []]
        assert scoring.error_counts == {"math_verify": 1, "math_answer": 0}
        # The replacement child keeps grading.
        assert [r.reward for r in scoring.score([("$\\frac{2}{4}$", "\\frac{1}{2}")])] == [2.0]


def test_a_job_asks_for_math_verify_by_type():
    scorer = parse_job(job(scorers=[{"type": "math_verify", "weight": 0.5}])).spec.scorers[0]
    assert scorer == MathVerify(weight=0.5, timeout_seconds=5.0)
    assert scorer_for(scorer) is math_verify
