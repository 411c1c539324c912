"""The rule scorers a job's reward sums (`spec.scorers`). Torch-free: part of the RLJob schema."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator

from rlfleet.workers.strict import Strict

class ScorerBase(Strict):
    weight: float = Field(1.0, ge=-1000.0, le=1000.0)
    """Factor of this scorer in the reward sum."""
    timeout_seconds: float = Field(1.0, gt=0.0, le=600.0)
    """A scorer slower than this on one completion scores 0 and counts an error."""


class MathAnswer(ScorerBase):
    """1 if the last number of the completion equals the answer numerically, else 0."""

    type: Literal["math_answer"] = "math_answer"


class ExactMatch(ScorerBase):
    """1 if the stripped completion equals the stripped answer, else 0."""

    type: Literal["exact_match"] = "exact_match"


class MathVerify(ScorerBase):
    """1 if math-verify (PyPI `math-verify`) grades the completion's final answer equal to the reference, else 0:
    LaTeX, `\\boxed{}`, fractions, sets, intervals and equivalent forms compare as mathematics."""

    type: Literal["math_verify"] = "math_verify"
    timeout_seconds: float = Field(5.0, gt=0.0, le=600.0)
    """A completion math-verify is still parsing or comparing after this long scores 0 and counts an error."""


class RegexFormat(ScorerBase):
    """1 if the completion fully matches `pattern`, else 0."""

    type: Literal["regex_format"] = "regex_format"
    pattern: str = Field(min_length=1, max_length=1024)
    """Python regular expression, matched against the whole completion."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a valid regular expression: {err}") from None
        return value


ScorerSpec = Annotated[Union[MathAnswer, MathVerify, ExactMatch, RegexFormat], Field(discriminator="type")]
