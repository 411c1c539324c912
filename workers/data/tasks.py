"""Prompt sources: deterministic arithmetic and user JSONL, each with a train stream and a held-out set.

Both train streams are position-addressed: example i depends only on the spec and i, so
`train(start=i)` resumes a run in O(1) from the position stored in its checkpoint.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

from rlfleet.workers.data.config import ArithmeticData, JsonlData, ReasoningGymData
from rlfleet.workers.storage.cache import default_cache_dir
from rlfleet.workers.storage.fetch import fetched_file

log = logging.getLogger(__name__)

# At most this share of the (a, op, b) space is held out, so tiny spaces keep most problems for training.
HELD_OUT_MAX_FRACTION = 0.2
CHAT_QUESTION = "What is {a} {op} {b}? Answer with just the number."
# `wordings: varied` trains on all of these; UNSEEN_WORDINGS are never trained on, only evaluated
# (`rlfleet eval --wordings unseen`): accuracy there says whether arithmetic was learned, not a template.
TRAIN_WORDINGS = (
    CHAT_QUESTION,
    "Compute {a} {op} {b}. Reply with only the result.",
    "{a} {op} {b} = ? Give just the number.",
    "Calculate {a} {op} {b} and answer with a single number.",
)
UNSEEN_WORDINGS = (
    "What do you get for {a} {op} {b}? Only the number, please.",
    "Work out {a} {op} {b}. Write nothing but the answer.",
    "Tell me the value of {a} {op} {b} as a number.",
)


# What a python scorer gets besides a row's other fields (`score(completion, answer, prompt, **fields)`).
SCORER_ARGUMENTS = frozenset({"completion", "answer", "prompt"})
ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """User data that cannot be used as it is: the message names the file and line."""


@dataclass(frozen=True)
class Example:
    id: str
    """Names the problem (not the stream position): repeats of one problem share it."""
    prompt: str
    """Text before templating: render_prompt turns it into token ids."""
    answer: str
    """Reference answer the scorers compare against."""
    solution: str = ""
    """A worked reference completion, what guidance trains on (docs/algorithms.md: Guidance); empty: the answer
    itself."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The data row's other fields (jsonl): python scorers get them as keyword arguments."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """The chat a chat template renders ({role, content} turns, the last the user's, whose content `prompt` is);
    empty: the prompt as the one user turn."""


class Task(Protocol):
    template: str
    train_size: int
    """Distinct training examples: one pass over the train stream."""

    def train(self, start: int = 0) -> Iterator[Example]:
        """Endless training stream from position `start`; never yields a held-out prompt."""
        ...

    def held_out(self, unseen_wordings: bool = False) -> list[Example]:
        """Evaluation examples, distinct and disjoint from training; asked in wordings training never used
        when `unseen_wordings` (tasks that have wordings only)."""
        ...


def task_for(data_spec: ArithmeticData | JsonlData | ReasoningGymData) -> Task:
    if data_spec.type == "arithmetic":
        return ArithmeticTask(data_spec)
    elif data_spec.type == "jsonl":
        return JsonlTask(data_spec)
    elif data_spec.type == "reasoning_gym":
        from rlfleet.workers.data.gym import ReasoningGymTask  # reasoning-gym: imported only where a job asks for it

        return ReasoningGymTask(data_spec)
    raise ValueError(f"unknown data type {data_spec.type!r}")


class ArithmeticTask:
    """Problems `a op b` indexed 0..size-1; held out = a seeded sample of indices, train = the rest."""

    def __init__(self, spec: ArithmeticData):
        self.spec = spec
        self.template = spec.template
        # Deduplicated, or a repeated op would give one prompt two indices (one held out, one not).
        self._ops = list(dict.fromkeys(spec.operations))
        self._side = spec.max_operand + 1
        self.size = self._side * self._side * len(self._ops)
        count = min(spec.held_out, int(self.size * HELD_OUT_MAX_FRACTION))
        if count < spec.held_out:
            log.warning("heldOut %d capped at %d: %.0f%% of the %d possible problems",
                        spec.held_out, count, 100 * HELD_OUT_MAX_FRACTION, self.size)
        # A string seed is hashed with SHA-512 by random.seed: stable across processes, unlike hash().
        rng = random.Random(f"rlfleet-held-out:{spec.seed}")
        self._held_out = rng.sample(range(self.size), count)
        self._held_out_set = frozenset(self._held_out)
        self.train_size = self.size - count

    def train(self, start: int = 0) -> Iterator[Example]:
        wordings = self._wordings()
        for position in itertools.count(start):
            wording = wordings[_stable_draw(self.spec.seed, position, -1, len(wordings))]
            yield self.example(self._train_index(position), wording)

    def held_out(self, unseen_wordings: bool = False) -> list[Example]:
        if unseen_wordings and self.template != "chat":
            raise ValueError("only chat questions have other wordings (data.template is plain)")
        wordings = UNSEEN_WORDINGS if unseen_wordings else self._wordings()
        return [self.example(index, wordings[n % len(wordings)]) for n, index in enumerate(self._held_out)]

    def example(self, index: int, wording: str = CHAT_QUESTION) -> Example:
        rest, b = divmod(index, self._side)
        op_index, a = divmod(rest, self._side)
        op = self._ops[op_index]
        if self.template == "chat":
            prompt = wording.format(a=a, op=op, b=b)
        else:
            prompt = f"{a}{op}{b}="
        result = _apply(a, op, b)
        # A chat model answers "3 - 14 = 14": a guide in that form corrects its number, not its form. A plain
        # prompt "3-14=" is completed by the answer alone.
        solution = f"{a} {op} {b} = {result}" if self.template == "chat" else ""
        return Example(id=f"arith:{a}{op}{b}", prompt=prompt, answer=str(result), solution=solution)

    def _wordings(self) -> tuple[str, ...]:
        return TRAIN_WORDINGS if self.spec.wordings == "varied" else (CHAT_QUESTION,)

    def _train_index(self, position: int) -> int:
        # Redraw on a held-out hit; at most 20% are held out, so 1.25 draws on average.
        attempt, index = 0, _stable_draw(self.spec.seed, position, 0, self.size)
        while index in self._held_out_set:
            attempt += 1
            index = _stable_draw(self.spec.seed, position, attempt, self.size)
        return index


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operation {op!r}")


def _stable_draw(seed: int, position: int, attempt: int, size: int) -> int:
    """Uniform in [0, size) from (seed, position, attempt); 128 bits make the modulo bias negligible."""
    digest = hashlib.blake2b(f"{seed}:{position}:{attempt}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") % size


class JsonlTask:
    """One JSON object per line (or a Parquet file's rows); the last `heldOut` examples are held out, train cycles over
    the rest, in file order or, with `shuffle`, in a seeded new order each pass."""

    def __init__(self, spec: JsonlData):
        self.spec = spec
        self.template = spec.template
        path = fetched_file(spec.uri, default_cache_dir()) if spec.uri else Path(spec.path)
        rows, unit = (_parquet_rows(path), "row") if spec.is_parquet else (_jsonl_rows(path), "line")
        examples = [_example(record, f"{path} {unit} {number}", f"{unit}-{number}", spec) for number, record in rows]
        if not examples:
            raise DataError(f"{path}: no examples")
        if spec.held_out >= len(examples):
            raise DataError(f"{spec.uri or spec.path}: heldOut {spec.held_out} leaves none of its "
                             f"{len(examples)} examples for training")
        split = len(examples) - spec.held_out
        self._held_out = examples[split:]
        held_prompts = {_conversation(example) for example in self._held_out}
        # A duplicate of a held-out prompt earlier in the file would leak it into training.
        self._train = [example for example in examples[:split] if _conversation(example) not in held_prompts]
        if not self._train:
            raise DataError(f"{spec.uri or spec.path}: every training prompt is also a held-out prompt")
        if len(self._train) < split:
            log.warning("%s: dropped %d training lines repeating a held-out prompt",
                        spec.uri or spec.path, split - len(self._train))
        self.train_size = len(self._train)
        self._pass_order: tuple[int, list[int]] = (-1, [])

    def train(self, start: int = 0) -> Iterator[Example]:
        for position in itertools.count(start):
            number, index = divmod(position, self.train_size)
            yield self._train[self._order(number)[index] if self.spec.shuffle else index]

    def _order(self, number: int) -> list[int]:
        """Pass `number`'s order of the training examples: a function of the seed and the pass alone, so a resumed
        stream repeats it."""
        if self._pass_order[0] != number:
            order = list(range(self.train_size))
            random.Random(f"rlfleet-shuffle:{self.spec.shuffle_seed}:{number}").shuffle(order)
            self._pass_order = (number, order)
        return self._pass_order[1]

    def held_out(self, unseen_wordings: bool = False) -> list[Example]:
        if unseen_wordings:
            raise ValueError("jsonl data has no other wordings: its prompts are the file's")
        return list(self._held_out)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(N, the JSON value of line N) of each line that is not blank."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as err:
        raise DataError(f"data.path {str(path)!r}: cannot open: {err.strerror}") from None
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, _json_line(line, path, number)
        except UnicodeDecodeError:
            raise DataError(f"data.path {str(path)!r}: not UTF-8 text (a Parquet file is read as one when its name "
                            "ends in .parquet)") from None


def _json_line(line: str, path: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path} line {number}: not valid JSON: {err.msg}") from None


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(N, row N as a dict of JSON values), N from 1: what the lines of a JSON lines file would hold. A column JSON has
    no type for (a timestamp, bytes) reaches a python scorer as its string."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'rlfleet[data]'") from None
    try:
        table = pyarrow.parquet.read_table(path)
    except FileNotFoundError as err:
        raise DataError(f"data.path {str(path)!r}: cannot open: {err.strerror}") from None
    except (OSError, pyarrow.ArrowException) as err:
        raise DataError(f"data.path {str(path)!r}: not a Parquet file ({err}): name JSON lines other than *.parquet")
    for number, row in enumerate(table.to_pylist(), start=1):
        yield number, json.loads(json.dumps(row, default=str))


def _example(record: Any, where: str, example_id: str, spec: JsonlData) -> Example:
    """The example of one line or row (`where` names it in errors): its prompt, or its chat, and its answer."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt_field, messages_field, answer_field = spec.prompt_field, spec.messages_field, spec.answer_field
    given = [name for name in (prompt_field, messages_field) if record.get(name) is not None]
    if not given:
        raise DataError(f"{where}: missing field {prompt_field!r} (has: {', '.join(sorted(record)) or 'none'}), "
                        f"or a chat in {messages_field!r}")
    if len(given) == 2:
        raise DataError(f"{where}: gives both {prompt_field!r} and {messages_field!r}: keep one, or name a field "
                        "it lacks in data.promptField or data.messagesField")
    if answer_field not in record:
        raise DataError(f"{where}: missing field {answer_field!r} (has: {', '.join(sorted(record)) or 'none'})")
    answer = record[answer_field]
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DataError(f"{where}: field {answer_field!r} must be a string or a number")
    if messages_field in given:
        messages = _messages(record[messages_field], f"{where}: field {messages_field!r}", spec.template)
    else:
        prompt = record[prompt_field]
        if not isinstance(prompt, str):
            raise DataError(f"{where}: field {prompt_field!r} must be a string, got {type(prompt).__name__}")
        messages = [{"role": "user", "content": prompt}]
    if spec.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    # A field named as a scorer argument (a `prompt` beside promptField: question) is that argument's already.
    named = {prompt_field, messages_field, answer_field, *SCORER_ARGUMENTS}
    fields = {key: value for key, value in record.items() if key not in named}
    # A chat of one user turn is a bare prompt: kept as the prompt alone, as a prompt field's.
    return Example(id=example_id, prompt=messages[-1]["content"], answer=str(answer),
                   messages=messages if len(messages) > 1 else [], fields=fields)


def _messages(chat: Any, where: str, template: str) -> list[dict[str, str]]:
    """A row's chat as {role, content} turns, refused unless a chat template can render it for the model to answer."""
    if template != "chat":
        raise DataError(f"{where}: a chat needs data.template: chat (a plain template renders a bare prompt)")
    if not isinstance(chat, list) or not chat:
        raise DataError(f"{where}: must be a non-empty list of {{role, content}} turns, got {type(chat).__name__}")
    messages = []
    for index, turn in enumerate(chat):
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            raise DataError(f"{where}: turn {index} must be an object with a string content")
        if turn.get("role") not in ROLES:
            raise DataError(f"{where}: turn {index} has role {turn.get('role')!r}, not one of {', '.join(ROLES)}")
        messages.append({"role": turn["role"], "content": turn["content"]})
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: the last turn must be the user's, for the model to answer (it is "
                        f"{messages[-1]['role']!r})")
    return messages


def _conversation(example: Example) -> str:
    """What the model is asked, as one comparable string: two examples that render alike give the same."""
    return json.dumps(chat(example))


def chat(example: Example) -> list[dict[str, str]]:
    """The example's chat: its messages, or its prompt as the one user turn."""
    return example.messages or [{"role": "user", "content": example.prompt}]


def render_prompt(example: Example, tokenizer, template: str) -> list[int]:
    """Prompt token ids as the generator receives them; the trainer never re-tokenizes."""
    if template == "plain":
        return list(tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
    elif template == "chat":
        # The template writes any BOS itself; return_dict=False because transformers 5 returns a dict.
        ids = tokenizer.apply_chat_template(
            chat(example), add_generation_prompt=True, tokenize=True, return_dict=False,
        )
        return [int(token) for token in ids]
    raise ValueError(f"unknown template {template!r}")
