"""Rule-based scorers (`Scoring` in scorer/batch.py runs them on batches).

A scorer is `(completion, answer, spec) -> float` in [0, 1]. Scorers read completions as text and
never execute them.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable

from rlfleet.workers.scorer.config import ScorerSpec

Scorer = Callable[[str, str, Any], float]

# ---------------------------------------------------------------- scorers

# ASCII digits only: Arabic-Indic, fullwidth and other Unicode digits are not read as numbers (the
# reference answers are ASCII, and int() would silently accept them). No exponents: "1e999", "inf" and
# "nan" are not numbers, so they never equal anything. Every pattern here runs in linear time: no
# nested quantifiers, and a number is only tried where one can start (lookbehind).
_NUMBER = re.compile(
    # Not the tail of a word, of another script's digits, of a decimal, or of LaTeX (x^2, \\sqrt{2}, \\pi/2).
    r"(?<![\w.^_{\\/])[-+]?"
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?"
)
# A numeral followed by these is a factor of an expression (3\\pi, 2x, 2\\sqrt{3}, 1e5, 2/\\pi), not a number.
_GLUED = re.compile(r"[A-Za-z\\^_{/]")
_FRAC = re.compile(r"\\d?frac\{(-?[0-9]+)\}\{([0-9]+)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
# Longer numerals are not answers; the cap also keeps int() far from its digit limit and quadratic cost.
MAX_NUMBER_CHARS = 100
REL_TOL = Fraction(1, 10**6)


def math_answer(completion: str, answer: str, spec: Any) -> float:
    """1 if the completion's final answer equals the reference answer numerically (relative 1e-6), else 0.

    Numbers only: optional sign, thousands commas (1,234), decimals, simple fractions a/b and \\frac{a}{b}.
    The completion's final answer is what its last `\\boxed{...}` holds (no answer when that is not a
    number: `\\boxed{3\\pi}`), else the first number after the last `####`, else after the last
    "answer is" / "answer:", else the last number of the text; a numeral glued to letters or LaTeX
    (3\\pi, 2x, x^2, \\sqrt{2}) is part of an expression, never a number.
    The reference must be a plain number (`reference_number`): a GSM8K "... #### 72" works as is, while
    a LaTeX reference such as `2\\sqrt{2}` scores every completion 0 (use the math_verify scorer for
    those; `rlfleet validate` refuses such data for a job that weighs math_answer).
    """
    got, want = final_number(completion), reference_number(answer)
    if got is None or want is None:
        return 0.0
    return float(abs(got - want) <= REL_TOL * max(abs(got), abs(want)))


def exact_match(completion: str, answer: str, spec: Any) -> float:
    """1 if the stripped completion equals the stripped answer."""
    return float(completion.strip() == answer.strip())


def regex_format(completion: str, answer: str, spec: Any) -> float:
    """1 if `spec.pattern` fully matches the completion with surrounding whitespace stripped.

    The pattern is the user's: a catastrophic one can hang, which is why `Scoring` runs scorers in a
    process it kills on timeout.
    """
    return float(re.fullmatch(spec.pattern, completion.strip()) is not None)


def scorer_for(spec: ScorerSpec) -> Scorer:
    if spec.type == "math_answer":
        return math_answer
    if spec.type == "math_verify":
        from rlfleet.workers.scorer.latex import math_verify  # sympy: imported only where a job asks for it

        return math_verify
    if spec.type == "exact_match":
        return exact_match
    if spec.type == "regex_format":
        return regex_format
    raise ValueError(f"unknown scorer type {spec.type!r}")


def final_number(text: str) -> Fraction | None:
    """The final answer of a completion as an exact number, or None if it has none."""
    text = _latex_numbers(text)
    if (box := text.rfind("\\boxed{")) >= 0:
        return plain_number(_braced(text, box + 7))
    declared = []  # where an answer is declared, most explicit first
    if (hashes := text.rfind("####")) >= 0:
        declared.append(text[hashes + 4 :])
    if markers := list(_ANSWER_IS.finditer(text)):
        declared.append(text[markers[-1].end() :])
    for segment in declared:
        if (found := _find_number(segment)) is not None:
            return found
    return _find_number(text, last=True)


def reference_number(answer: str) -> Fraction | None:
    """A reference answer as an exact number: all of it, or what follows its last `####` (GSM8K), or what its
    last `\\boxed{}` holds, must be one plain number; None for anything else (`2\\sqrt{2}`, `x^2`, `(1,2)`)."""
    text = _latex_numbers(answer)
    if (hashes := text.rfind("####")) >= 0:
        text = text[hashes + 4 :]
    elif (box := text.rfind("\\boxed{")) >= 0:
        text = _braced(text, box + 7)
    return plain_number(text)


def plain_number(text: str) -> Fraction | None:
    """The number a text is, spaces and `$` around it aside, or None when it is anything more."""
    text = text.strip().strip("$").strip()
    match = _NUMBER.fullmatch(text)
    return None if match is None else _number(text, match)


def _latex_numbers(text: str) -> str:
    """Text with LaTeX's numerals written plainly: \\frac{3}{4} as 3/4, 1{,}000 as 1,000."""
    return _FRAC.sub(r"\1/\2", text).replace("{,}", ",")


def _braced(text: str, start: int) -> str:
    """The text from start up to the brace that closes the one just before it."""
    depth = 1
    for end in range(start, len(text)):
        depth += (text[end] == "{") - (text[end] == "}")
        if depth == 0:
            return text[start:end]
    return text[start:]


def _find_number(text: str, last: bool = False) -> Fraction | None:
    matches = _NUMBER.finditer(text)
    for match in reversed(list(matches)) if last else matches:
        if (found := _number(text, match)) is not None:
            return found
    return None


def _number(text: str, match: re.Match[str]) -> Fraction | None:
    """The matched numeral's value, or None when it is only part of something else (1e5, 3٤, 3\\pi, a/0)."""
    token, end = match.group(), match.end()
    if len(token) > MAX_NUMBER_CHARS or _GLUED.match(text, end) or text[end : end + 1].isdigit():
        return None
    numerator, _, denominator = token.replace(",", "").partition("/")
    if denominator:
        return Fraction(int(numerator), int(denominator)) if int(denominator) else None
    return Fraction(numerator)
