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
    r"(?<![\w.])[-+]?"  # not the tail of a word, of another script's digits or of a decimal
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?"
)
_EXPONENT = re.compile(r"[eE][-+]?[0-9]")
_FRAC = re.compile(r"\\d?frac\{(-?[0-9]+)\}\{([0-9]+)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
# Longer numerals are not answers; the cap also keeps int() far from its digit limit and quadratic cost.
MAX_NUMBER_CHARS = 100
REL_TOL = Fraction(1, 10**6)


def math_answer(completion: str, answer: str, spec: Any) -> float:
    """1 if the completion's final answer equals the reference answer numerically (relative 1e-6).

    The final answer is the number in the last `\\boxed{...}`, else the first number after the last
    `####`, else after the last "answer is" / "answer:", else the last number of the text. Numbers:
    optional sign, thousands commas (1,234), decimals, simple fractions a/b (and \\frac{a}{b} in a box).
    The reference answer goes through the same extraction, so a GSM8K "... #### 72" works as is.
    """
    got, want = final_number(completion), final_number(answer)
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
    if spec.type == "exact_match":
        return exact_match
    if spec.type == "regex_format":
        return regex_format
    raise ValueError(f"unknown scorer type {spec.type!r}")


def final_number(text: str) -> Fraction | None:
    """The final answer of a text as an exact number, or None if it has none."""
    declared = []  # where an answer is declared, most explicit first
    if (box := text.rfind("\\boxed{")) >= 0:
        declared.append(_FRAC.sub(r"\1/\2", _braced(text, box + 7).replace("{,}", ",")))
    if (hashes := text.rfind("####")) >= 0:
        declared.append(text[hashes + 4 :])
    if markers := list(_ANSWER_IS.finditer(text)):
        declared.append(text[markers[-1].end() :])
    for segment in declared:
        if (found := _find_number(segment)) is not None:
            return found
    return _find_number(text, last=True)


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
    """The matched numeral's value, or None when it is only part of something else (1e5, 3٤, a/0)."""
    token, end = match.group(), match.end()
    if len(token) > MAX_NUMBER_CHARS or _EXPONENT.match(text, end) or text[end : end + 1].isdigit():
        return None
    numerator, _, denominator = token.replace(",", "").partition("/")
    if denominator:
        return Fraction(int(numerator), int(denominator)) if int(denominator) else None
    return Fraction(numerator)
