"""Built-in arithmetic and user JSONL tasks: determinism, held-out split, answers, errors, resume."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from rlfleet.workers.data import ArithmeticTask, DataError, Example, JsonlTask, render_prompt, task_for
from rlfleet.workers.data.config import ArithmeticData, JsonlData

PLAIN = re.compile(r"^(\d+)([-+*])(\d+)=$")
CHAT = re.compile(r"^What is (\d+) ([-+*]) (\d+)\? Answer with just the number\.$")


def take(iterator, count):
    return list(itertools.islice(iterator, count))


def evaluate(prompt: str) -> int:
    match = PLAIN.match(prompt) or CHAT.match(prompt)
    assert match, prompt
    a, op, b = int(match[1]), match[2], int(match[3])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_same_seed_same_stream_and_other_seed_differs():
    spec = ArithmeticData(max_operand=99, operations=["+", "-", "*"], seed=3)
    first = take(ArithmeticTask(spec).train(), 500)
    assert first == take(ArithmeticTask(spec).train(), 500)
    assert ArithmeticTask(spec).held_out() == ArithmeticTask(spec).held_out()
    other = take(ArithmeticTask(spec.model_copy(update={"seed": 4})).train(), 500)
    assert first != other


@pytest.mark.parametrize(
    "spec",
    [
        ArithmeticData(max_operand=99, operations=["+", "-", "*"], held_out=200),
        ArithmeticData(max_operand=9, operations=["+"], held_out=200),  # 100 problems: capped
        ArithmeticData(max_operand=1000, operations=["*"], held_out=1000, template="chat"),
        ArithmeticData(max_operand=4, operations=["+", "+", "-"], held_out=10),  # repeated op
    ],
)
def test_held_out_distinct_and_disjoint_from_train(spec):
    task = ArithmeticTask(spec)
    held = task.held_out()
    prompts = {example.prompt for example in held}
    assert len(prompts) == len(held) > 0
    assert len(held) <= max(1, task.size // 5)
    train_prompts = {example.prompt for example in take(task.train(), 10_000)}
    assert not prompts & train_prompts


def test_tiny_space_caps_held_out_and_still_trains_on_the_rest():
    task = ArithmeticTask(ArithmeticData(max_operand=9, operations=["+"], held_out=200))
    assert len(task.held_out()) == 20  # 20% of 10 * 10 problems
    seen = {example.prompt for example in take(task.train(), 5_000)}
    assert len(seen) == 80


@pytest.mark.parametrize("template", ["plain", "chat"])
def test_answers_are_exact_integers(template):
    spec = ArithmeticData(max_operand=50, operations=["+", "-", "*"], template=template)
    task = ArithmeticTask(spec)
    examples = take(task.train(), 2_000) + task.held_out()
    for example in examples:
        assert example.answer == str(evaluate(example.prompt))
    assert any(example.answer.startswith("-") for example in examples)
    assert {example.prompt[-1] for example in examples} == ({"="} if template == "plain" else {"."})


@pytest.mark.parametrize("template", ["plain", "chat"])
def test_a_chat_solution_restates_the_problem_and_scores_as_its_answer(template):
    """Guidance trains on the solution: it must be what the scorer rewards, in the chat model's form."""
    from rlfleet.workers.scorer.config import MathAnswer
    from rlfleet.workers.scorer.rules import math_answer

    task = ArithmeticTask(ArithmeticData(max_operand=20, operations=["+", "-", "*"], template=template))
    for example in take(task.train(), 300):
        if template == "plain":
            assert example.solution == ""
            continue
        a, op, b = CHAT.match(example.prompt).groups()
        assert example.solution == f"{a} {op} {b} = {example.answer}"
        assert math_answer(example.solution, example.answer, MathAnswer()) == 1.0


def test_operands_cover_the_range_and_only_the_given_ops():
    task = ArithmeticTask(ArithmeticData(max_operand=5, operations=["-", "*"], held_out=0))
    matches = [PLAIN.match(example.prompt) for example in take(task.train(), 3_000)]
    assert {m[2] for m in matches} == {"-", "*"}
    assert {int(m[1]) for m in matches} == set(range(6))
    assert {int(m[3]) for m in matches} == set(range(6))


def test_arithmetic_resume_position():
    task = ArithmeticTask(ArithmeticData(max_operand=99, operations=["+", "*"]))
    stream = take(task.train(), 1_000)
    assert take(task.train(start=700), 300) == stream[700:]
    assert next(task.train(start=10**12)).answer  # far positions cost nothing to reach


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_jsonl_held_out_is_the_tail_and_train_cycles(tmp_path):
    rows = [json.dumps({"q": f"question {i}", "a": i}) for i in range(10)]
    path = write_jsonl(tmp_path / "data.jsonl", rows[:5] + [""] + rows[5:])
    task = task_for(JsonlData(path=path, prompt_field="q", answer_field="a", held_out=3))
    assert isinstance(task, JsonlTask)
    assert [e.prompt for e in task.held_out()] == ["question 7", "question 8", "question 9"]
    train = take(task.train(), 14)
    assert [e.prompt for e in train[:7]] == [f"question {i}" for i in range(7)]
    assert train[7:] == train[:7]
    assert train[0] == Example(id="line-1", prompt="question 0", answer="0")
    assert train[5].id == "line-7"  # the blank line 6 still counts
    assert take(task.train(start=12), 2) == train[12:14]


def test_jsonl_shuffle_trains_each_pass_in_a_new_seeded_order(tmp_path):
    rows = [json.dumps({"prompt": f"question {i}", "answer": i}) for i in range(12)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    task = JsonlTask(JsonlData(path=path, held_out=2, shuffle=True, shuffle_seed=3))
    stream = [e.prompt for e in take(task.train(), 30)]
    passes = [stream[0:10], stream[10:20], stream[20:30]]
    assert all(sorted(p) == sorted(f"question {i}" for i in range(10)) for p in passes)  # each pass: each line once
    assert passes[0] != [f"question {i}" for i in range(10)]
    assert passes[0] != passes[1] != passes[2]
    assert [e.prompt for e in take(task.train(start=17), 13)] == stream[17:]  # a resumed run repeats the order
    again = JsonlTask(JsonlData(path=path, held_out=2, shuffle=True, shuffle_seed=3))
    assert [e.prompt for e in take(again.train(), 30)] == stream
    other = JsonlTask(JsonlData(path=path, held_out=2, shuffle=True, shuffle_seed=4))
    assert [e.prompt for e in take(other.train(), 10)] != passes[0]
    assert [e.prompt for e in task.held_out()] == ["question 10", "question 11"]


def test_jsonl_drops_training_copies_of_held_out_prompts(tmp_path):
    rows = [json.dumps({"prompt": p, "answer": "x"}) for p in ["a", "b", "c", "b"]]
    task = JsonlTask(JsonlData(path=write_jsonl(tmp_path / "d.jsonl", rows), held_out=1))
    assert [e.prompt for e in take(task.train(), 4)] == ["a", "c", "a", "c"]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "p"}', "line 3: missing field 'answer'"),
        ('{"answer": "1"}', "line 3: missing field 'prompt'"),
        ("{not json", "line 3: not valid JSON"),
        ('["prompt", "answer"]', "line 3: expected a JSON object"),
        ('{"prompt": 5, "answer": "1"}', "line 3: field 'prompt' must be a string"),
    ],
)
def test_jsonl_errors_name_the_line_and_field(tmp_path, bad_line, message):
    good = json.dumps({"prompt": "p", "answer": "a"})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_line, good])
    with pytest.raises(DataError, match=re.escape(message)):
        JsonlTask(JsonlData(path=path))


def test_jsonl_rows_keep_their_other_fields_for_the_scorers(tmp_path):
    rows = [{"question": f"q{i}", "solution": i, "tests": [i, i + 1], "prompt": "not the prompt"} for i in range(3)]
    task = JsonlTask(JsonlData(path=write_jsonl(tmp_path / "d.jsonl", map(json.dumps, rows)), prompt_field="question",
                               answer_field="solution", held_out=1))
    first = next(task.train())
    # `prompt` is the scorer's own argument (the question here): a field of that name is left out.
    assert (first.prompt, first.answer, first.fields) == ("q0", "0", {"tests": [0, 1]})
    assert task.held_out()[0].fields == {"tests": [2, 3]}


def test_jsonl_file_and_held_out_errors(tmp_path):
    with pytest.raises(DataError, match="cannot open"):
        JsonlTask(JsonlData(path=str(tmp_path / "missing.jsonl")))
    path = write_jsonl(tmp_path / "two.jsonl", [json.dumps({"prompt": "p", "answer": i}) for i in range(2)])
    with pytest.raises(DataError, match="leaves none"):
        JsonlTask(JsonlData(path=path, held_out=2))


def test_task_for_picks_the_class():
    assert isinstance(task_for(ArithmeticData()), ArithmeticTask)


class CharTokenizer:
    """Stands in for a HF tokenizer: what render_prompt calls, with the transformers 5 return types."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict
        return [ord(c) for c in f"<{messages[0]['content']}>"]


def test_render_prompt_plain_and_chat():
    example = Example(id="x", prompt="1+2=", answer="3")
    assert render_prompt(example, CharTokenizer(), "plain") == [ord(c) for c in "1+2="]
    chat = render_prompt(example, CharTokenizer(), "chat")
    assert chat == [ord(c) for c in "<1+2=>"] and all(type(t) is int for t in chat)
    with pytest.raises(ValueError, match="template"):
        render_prompt(example, CharTokenizer(), "other")


def _problem(example: Example) -> tuple[int, str, int]:
    a, op, b = re.search(r"(\d+) ([-+*]) (\d+)", example.prompt).groups()
    return int(a), op, int(b)


def test_varied_wordings_train_on_several_and_hold_others_out():
    from rlfleet.workers.data.tasks import TRAIN_WORDINGS, UNSEEN_WORDINGS

    spec = ArithmeticData(max_operand=99, operations=["+", "-", "*"], template="chat", wordings="varied")
    task = ArithmeticTask(spec)
    trained = take(task.train(), 400)
    frames = {re.sub(r"\d+ [-+*] \d+", "X", e.prompt) for e in trained}
    assert frames == {w.format(a=0, op="+", b=0).replace("0 + 0", "X") for w in TRAIN_WORDINGS}
    unseen = task.held_out(unseen_wordings=True)
    assert {re.sub(r"\d+ [-+*] \d+", "X", e.prompt) for e in unseen} == {
        w.format(a=0, op="+", b=0).replace("0 + 0", "X") for w in UNSEEN_WORDINGS}
    assert not frames & {e.prompt for e in unseen}
    # The same problems and answers, only asked differently.
    assert [(_problem(e), e.answer) for e in unseen] == [(_problem(e), e.answer) for e in task.held_out()]
    assert {_problem(e) for e in unseen}.isdisjoint(_problem(e) for e in trained)


def test_one_wording_keeps_the_stream_it_always_had():
    spec = ArithmeticData(max_operand=99, operations=["+", "-"], template="chat")
    assert all(CHAT.match(e.prompt) for e in take(ArithmeticTask(spec).train(), 100) + ArithmeticTask(spec).held_out())
    varied = ArithmeticTask(spec.model_copy(update={"wordings": "varied"}))
    assert [_problem(e) for e in take(varied.train(), 100)] == [
        _problem(e) for e in take(ArithmeticTask(spec).train(), 100)]


def test_plain_and_jsonl_prompts_have_no_other_wordings(tmp_path):
    with pytest.raises(ValueError, match="plain"):
        ArithmeticTask(ArithmeticData()).held_out(unseen_wordings=True)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    with pytest.raises(ValueError, match="no other wordings"):
        JsonlTask(JsonlData(path=str(data), held_out=1)).held_out(unseen_wordings=True)


def test_a_chat_row_and_the_system_prompt_render_through_the_chat_template(tmp_path):
    from rlfleet.workers.models.tiny import build_tokenizer

    chat = [{"role": "system", "content": "Own system."}, {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="}]
    rows = [{"messages": chat, "answer": 4}, {"prompt": "3+3=", "answer": 6},
            {"messages": [{"role": "user", "content": "4+4="}], "answer": 8}]
    path = write_jsonl(tmp_path / "chat.jsonl", [json.dumps(row) for row in rows])
    task = JsonlTask(JsonlData(path=path, template="chat", system_prompt="Be brief."))
    tokenizer = build_tokenizer()
    texts = [tokenizer.decode(render_prompt(e, tokenizer, "chat")) for e in take(task.train(), 3)]
    assert texts == ["system: Own system.\nuser: 1+1=\nassistant: 2\nuser: 2+2=\nassistant: ",
                     "system: Be brief.\nuser: 3+3=\nassistant: ",
                     "system: Be brief.\nuser: 4+4=\nassistant: "]
    # Scorers and logs see the turn the model answers.
    assert [e.prompt for e in take(task.train(), 3)] == ["2+2=", "3+3=", "4+4="]


def test_a_chat_that_repeats_a_held_out_one_is_dropped_one_with_other_turns_is_not(tmp_path):
    def row(*turns):
        return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns], "answer": 1})

    held = row(("system", "S"), ("user", "q"))
    rows = [held, row(("system", "T"), ("user", "q")), row(("user", "q")), held]
    task = JsonlTask(JsonlData(path=write_jsonl(tmp_path / "d.jsonl", rows), template="chat", held_out=1))
    assert [e.id for e in take(task.train(), 2)] == ["line-2", "line-3"]


def test_a_system_prompt_needs_the_chat_template():
    with pytest.raises(ValueError, match="systemPrompt is a chat message: set template: chat"):
        JsonlData(path="d.jsonl", system_prompt="Be brief.")


def test_a_binary_file_named_as_json_lines_is_refused_naming_parquet(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b"PAR1\x15\x04\x9a\xff\x00")
    with pytest.raises(DataError, match="not UTF-8 text \\(a Parquet file is read as one when its name ends in"):
        JsonlTask(JsonlData(path=str(tmp_path / "train.jsonl")))
