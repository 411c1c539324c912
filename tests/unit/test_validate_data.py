"""`rlfleet validate` opens the job's data: a file the controller could not train on is refused naming its line and
field, before any run starts (`rlfleet run` makes the same check: tests/unit/test_run_refuses.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from bad_jobs import job

from rlfleet.workers import cli

GOOD = json.dumps({"prompt": "1+1=", "answer": "2"})


def validate(tmp_path, lines: list[str] | None, **spec) -> None:
    """`rlfleet validate` of a job whose data.jsonl holds `lines` (None: no file)."""
    if lines is not None:
        (tmp_path / "data.jsonl").write_text("".join(line + "\n" for line in lines))
    data = {"type": "jsonl", "path": str(tmp_path / "data.jsonl"), **spec.pop("data", {})}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(data=data, **spec)))
    assert cli.main(["validate", str(tmp_path / "job.yaml")]) == 0


def refusal(tmp_path, lines: list[str] | None, **spec) -> str:
    with pytest.raises(SystemExit) as refused:
        validate(tmp_path, lines, **spec)
    return str(refused.value.code)


def test_a_missing_file_is_refused(tmp_path):
    assert f"data.path {str(tmp_path / 'data.jsonl')!r}: cannot open" in refusal(tmp_path, None)


@pytest.mark.parametrize(
    "bad_line, message",
    [("{not json", "line 2: not valid JSON"),
     (json.dumps({"prompt": "2+2="}), "line 2: missing field 'answer'"),
     (json.dumps({"question": "2+2=", "answer": "4"}), "line 2: missing field 'prompt' (has: answer, question)")],
)
def test_a_bad_line_is_refused_naming_the_line_and_field(tmp_path, bad_line, message):
    assert message in refusal(tmp_path, [GOOD, bad_line, GOOD])


def test_the_job_s_own_field_names_are_checked(tmp_path):
    lines = [json.dumps({"q": "1+1=", "a": 2}), json.dumps({"q": "2+2="})]
    assert "line 2: missing field 'a'" in refusal(tmp_path, lines, data={"promptField": "q", "answerField": "a"})


def test_held_out_that_leaves_nothing_to_train_on_is_refused(tmp_path):
    assert "heldOut 2 leaves none of its 2 examples" in refusal(tmp_path, [GOOD, GOOD], data={"heldOut": 2})


def test_a_latex_answer_is_refused_for_math_answer_and_taken_by_math_verify(tmp_path):
    lines = [GOOD, json.dumps({"prompt": "Half?", "answer": "\\frac{1}{2}"}),
             json.dumps({"prompt": "Side?", "answer": "2\\sqrt{2}"})]
    message = refusal(tmp_path, lines)  # math_answer is the default scorer
    assert "line 3: field 'answer' is '2\\\\sqrt{2}', not a plain number" in message
    assert "math_verify" in message
    validate(tmp_path, lines, scorers=[{"type": "math_verify"}])
    validate(tmp_path, lines, scorers=[{"type": "math_answer", "weight": 0}, {"type": "math_verify"}])


def test_a_good_file_validates_and_the_job_is_printed(tmp_path, capsys):
    validate(tmp_path, [GOOD, "", json.dumps({"prompt": "2+2=", "answer": 4})], data={"heldOut": 1})
    assert json.loads(capsys.readouterr().out)["spec"]["data"]["heldOut"] == 1


def test_a_uri_is_left_to_rlfleet_run(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(data={"type": "jsonl", "uri": "s3://bucket/d.jsonl"})))
    assert cli.main(["validate", str(tmp_path / "job.yaml")]) == 0
    assert "not fetched here" in capsys.readouterr().err


def _chat(*turns) -> str:
    return json.dumps({"messages": [{"role": role, "content": "hi"} for role in turns], "answer": "2"})


@pytest.mark.parametrize("bad_line, message", [
    (json.dumps({"messages": "hi", "answer": "2"}), "line 2: field 'messages': must be a non-empty list"),
    (json.dumps({"messages": [], "answer": "2"}), "line 2: field 'messages': must be a non-empty list"),
    (json.dumps({"messages": [{"role": "user"}], "answer": "2"}), "line 2: field 'messages': turn 0 must be an "
                                                                   "object with a string content"),
    (_chat("system", "function", "user"), "line 2: field 'messages': turn 1 has role 'function', not one of system, "
                                          "user, assistant, tool"),
    (_chat("user", "assistant"), "line 2: field 'messages': the last turn must be the user's"),
    (json.dumps({"prompt": "1+1=", "messages": [{"role": "user", "content": "1+1="}], "answer": "2"}),
     "line 2: gives both 'prompt' and 'messages'"),
])
def test_a_malformed_chat_is_refused_naming_the_line_and_field(tmp_path, bad_line, message):
    assert message in refusal(tmp_path, [GOOD, bad_line], data={"template": "chat"})


def test_a_chat_needs_the_chat_template_and_the_field_name_is_the_job_s(tmp_path):
    lines = [GOOD, json.dumps({"chat": [{"role": "user", "content": "1+1="}], "answer": "2"})]
    assert "line 2: field 'chat': a chat needs data.template: chat" in refusal(
        tmp_path, lines, data={"messagesField": "chat"})
    validate(tmp_path, lines, data={"messagesField": "chat", "template": "chat", "systemPrompt": "Be brief."})


def test_a_data_path_on_the_job_s_volumes_is_left_to_the_cluster(tmp_path, capsys):
    """A cluster job's data lies on a claim, not on the machine that validates it; a path on no volume is still read."""
    volumes = {"volumes": [{"name": "store", "claim": "rl-store", "mountPath": "/store"}]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(data={"type": "jsonl", "path": "/store/train.jsonl"},
                                                          storage=volumes)))
    assert cli.main(["validate", str(tmp_path / "job.yaml")]) == 0
    assert "data.path /store/train.jsonl is on the job's volumes, not here" in capsys.readouterr().err
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(data={"type": "jsonl", "path": "/elsewhere/train.jsonl"},
                                                          storage=volumes)))
    with pytest.raises(SystemExit, match="data.path '/elsewhere/train.jsonl': cannot open"):
        cli.main(["validate", str(tmp_path / "job.yaml")])
