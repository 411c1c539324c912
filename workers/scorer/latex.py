"""The `math_verify` scorer: answers in LaTeX graded by math-verify (PyPI `math-verify`, sympy underneath).

It runs in `Scoring`'s child process like every rule scorer, and math-verify's own timeouts are off: they use
signal.alarm, and the child already enforces `timeoutSeconds` by killing itself from the parent, which also
catches a hang in sympy's C code that no alarm handler would reach.
"""

from __future__ import annotations

import logging
from typing import Any

# math-verify warns once per process that its timeouts are off: here that is by design (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

from math_verify import parse, verify  # noqa: E402 - after its logger is quietened

# Marks a reference that already says where its answer is, which math-verify then finds itself.
_DELIMITERS = ("$", "\\boxed", "\\(", "\\[")


def math_verify(completion: str, answer: str, spec: Any) -> float:
    """1 if math-verify finds the completion's final answer (its last `\\boxed{}`, else a `$...$` or plain number
    or expression it recognises) equal to the reference, else 0; 0 too where the completion has no answer.

    The reference is read as `reference_latex` says; an unparseable one scores every completion 0.
    """
    gold = parse(reference_latex(answer), parsing_timeout=None)
    got = parse(completion, parsing_timeout=None)
    return float(bool(gold) and bool(got) and verify(gold, got, timeout_seconds=None))


def reference_latex(answer: str) -> str:
    """The reference as math-verify should read it: as it is when it delimits its answer (`$...$`, `\\boxed{}`),
    else the part after a GSM8K `####`, else the whole answer as one LaTeX formula (MATH stores bare `\\frac{1}{2}`,
    which math-verify would otherwise read as its first number)."""
    if any(mark in answer for mark in _DELIMITERS):
        return answer
    if (hashes := answer.rfind("####")) >= 0:
        answer = answer[hashes + 4 :]
    return f"${answer.strip()}$"
