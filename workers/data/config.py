"""The prompts a job trains on (`spec.data`). Torch-free: part of the RLJob schema."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, field_validator, model_validator

from rlfleet.workers.storage import uris
from rlfleet.workers.strict import MAX_SEED, Strict

class ArithmeticData(Strict):
    """Deterministic arithmetic prompts `a op b`; the answer is the exact integer result."""

    type: Literal["arithmetic"] = "arithmetic"
    max_operand: int = Field(9, ge=1, le=10**6)
    """Operands are drawn from 0..maxOperand."""
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1)
    """Operators to draw from."""
    template: Literal["plain", "chat"] = "plain"
    """plain: `3+4=`; chat: a question through the tokenizer's chat template."""
    wordings: Literal["one", "varied"] = "one"
    """chat only: one: every question worded alike; varied: each training question drawn from several wordings.
    Other wordings, never trained on, are kept for `rlfleet eval --wordings unseen`."""
    held_out: int = Field(200, ge=0, le=100000)
    """Prompts reserved for evaluation, never trained on."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the prompt stream."""


class JsonlData(Strict):
    """User data: one JSON object per line (or one Parquet row, for a file named *.parquet) with a prompt or a chat
    and an answer field."""

    type: Literal["jsonl"] = "jsonl"
    path: str | None = Field(None, min_length=1, max_length=4096)
    """File path, as seen by the trainer: JSON lines, or Parquet when the name ends in .parquet."""
    uri: str | None = Field(None, max_length=4096)
    """Instead of path: s3://BUCKET/KEY or hf://datasets/OWNER/NAME[@REVISION]/FILE, fetched once into the cache."""
    prompt_field: str = Field("prompt", min_length=1, max_length=256)
    """Key of the prompt text."""
    messages_field: str = Field("messages", min_length=1, max_length=256)
    """Key of a chat, instead of the prompt: [{role, content}, ...], the last turn the user's (template chat)."""
    answer_field: str = Field("answer", min_length=1, max_length=256)
    """Key of the reference answer."""
    template: Literal["plain", "chat"] = "plain"
    """plain: the prompt as it is; chat: through the tokenizer's chat template."""
    system_prompt: str | None = Field(None, min_length=1, max_length=65536)
    """chat only: a system message before each prompt whose chat has none of its own."""
    held_out: int = Field(0, ge=0, le=100000)
    """Examples reserved for evaluation, never trained on: the file's last ones (blank lines aside)."""
    shuffle: bool = False
    """false: train in file order, pass after pass; true: each pass over the training lines in a new order."""
    shuffle_seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the shuffled orders (the same seed, the same orders, a resumed run included)."""

    @field_validator("uri")
    @classmethod
    def _file_uri(cls, value: str | None) -> str | None:
        return value if value is None else uris.check_file(value)

    @model_validator(mode="after")
    def _one_source(self) -> JsonlData:
        return uris.one_source(self, "a file the trainer sees", "s3://BUCKET/KEY or hf://datasets/OWNER/NAME/FILE")

    @model_validator(mode="after")
    def _system_prompt_is_a_chat_message(self) -> JsonlData:
        if self.system_prompt is not None and self.template != "chat":
            raise ValueError("systemPrompt is a chat message: set template: chat (a plain template gives the model "
                             "the prompt as it is; write the instruction into the prompts instead)")
        return self

    @property
    def is_parquet(self) -> bool:
        """A file named *.parquet (the path's, or the URI's file) is read as Parquet, any other as JSON lines."""
        return (self.path or self.uri or "").lower().endswith(".parquet")


class GymDataset(Strict):
    """One reasoning-gym dataset of a mix: its share and its own options."""

    weight: float = Field(1.0, gt=0.0, le=1e6)
    """Its share of the prompts, relative to the other datasets' weights."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The dataset's own options (its config class's fields, e.g. chain_sum's maxTerms as max_terms)."""


def _weights_as_datasets(value: Any) -> Any:
    """`{chain_sum: 2}` is short for `{chain_sum: {weight: 2}}`."""
    if not isinstance(value, dict):
        return value
    return {name: {"weight": spec} if isinstance(spec, (int, float)) and not isinstance(spec, bool) else spec
            for name, spec in value.items()}


# The schema (and the CRD) take either form; the model holds {weight, config}.
_WEIGHTS = BeforeValidator(_weights_as_datasets, json_schema_input_type=dict[str, Union[float, GymDataset]])


class ReasoningGymData(Strict):
    """Procedural problems from reasoning-gym (PyPI `reasoning-gym`), a weighted mix of its datasets; the
    `reasoning_gym` scorer grades answers by each dataset's own check."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    datasets: Annotated[dict[str, GymDataset], _WEIGHTS] = Field(min_length=1, max_length=128)
    """Dataset name -> its weight, or -> {weight, config} (docs/data.md: reasoning-gym)."""
    size: int = Field(10000, ge=1, le=10**7)
    """Distinct training problems: the stream cycles over problems 0..size-1."""
    held_out: int = Field(200, ge=0, le=100000)
    """Problems reserved for evaluation (problems size.. size+heldOut-1), never trained on."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the prompt stream."""
    template: Literal["plain", "chat"] = "chat"
    """chat: the question through the tokenizer's chat template; plain: the question as it is."""
    system_prompt: str | None = Field(None, max_length=65536)
    """How to answer. None: reasoning-gym's own (think, then the answer between <answer> tags, which the
    reasoning_gym scorer reads); "": none. A system message (chat), or the text before the question (plain)."""


DataSpec = Annotated[Union[ArithmeticData, JsonlData, ReasoningGymData], Field(discriminator="type")]
