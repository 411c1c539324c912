"""The rule scorers a job's reward sums (`spec.scorers`). Torch-free: part of the RLJob schema."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, field_validator

from rlfleet.workers.strict import Strict
from rlfleet.workers.user_code import UserCode

class ScorerBase(Strict):
    weight: float = Field(1.0, ge=-1000.0, le=1000.0)
    """Factor of this scorer in the reward sum."""
    timeout_seconds: float = Field(1.0, gt=0.0, le=600.0)
    """A scorer slower than this on one completion scores 0 and counts an error."""
    grades_answers: ClassVar[bool] = False
    """Whether it scores 1 for a right answer and 0 otherwise: the share of 1s it gives the held-out completions is
    the evaluation's accuracy (the job's first such scorer's)."""


class MathAnswer(ScorerBase):
    """1 if the last number of the completion equals the answer numerically, else 0."""

    type: Literal["math_answer"] = "math_answer"
    grades_answers: ClassVar[bool] = True


class ExactMatch(ScorerBase):
    """1 if the stripped completion equals the stripped answer, else 0."""

    type: Literal["exact_match"] = "exact_match"
    grades_answers: ClassVar[bool] = True


class MathVerify(ScorerBase):
    """1 if math-verify (PyPI `math-verify`) grades the completion's final answer equal to the reference, else 0:
    LaTeX, `\\boxed{}`, fractions, sets, intervals and equivalent forms compare as mathematics."""

    type: Literal["math_verify"] = "math_verify"
    grades_answers: ClassVar[bool] = True
    timeout_seconds: float = Field(5.0, gt=0.0, le=600.0)
    """A completion math-verify is still parsing or comparing after this long scores 0 and counts an error."""


class ReasoningGym(ScorerBase):
    """reasoning-gym's own check of each problem (`data.type: reasoning_gym` only): the dataset's
    `score_answer` on the answer the completion gives between <answerTag> tags, in [0, 1] (some datasets give
    partial credit)."""

    grades_answers: ClassVar[bool] = True
    type: Literal["reasoning_gym"] = "reasoning_gym"
    answer_tag: str | None = Field("answer", min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")
    """The completion's answer is what its last <answerTag>...</answerTag> holds (reasoning-gym's convention; none
    scores 0); null: the whole completion."""
    timeout_seconds: float = Field(5.0, gt=0.0, le=600.0)
    """A check still running after this long scores 0 and counts an error."""


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


class PythonScorer(ScorerBase, UserCode):
    """The user's function `score(completion, answer, prompt, **fields) -> float | dict[str, float]`, from a file
    (`path`) or an installed module (`module`); docs/rewards.md. It runs in the scorer's child process: a call that
    raises, overruns timeoutSeconds, returns no finite number, exhausts memoryMib or kills the process scores 0."""

    kind: ClassVar[str] = "reward"
    checker: ClassVar[str] = "rlfleet.workers.scorer.python"
    type: Literal["python"] = "python"
    function: str = Field("score", max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The function's name in the file or module."""
    memory_mib: int = Field(1024, ge=64, le=65536)
    """Memory the function may allocate over the scorer child's own; a call past it scores 0."""

    def attribute(self) -> str:
        return self.function

    def fix(self) -> str:
        return f"define `def {self.function}(completion, answer, prompt, **fields)`, or set function to its name"


ScorerSpec = Annotated[Union[MathAnswer, MathVerify, ExactMatch, RegexFormat, ReasoningGym, PythonScorer],
                       Field(discriminator="type")]
