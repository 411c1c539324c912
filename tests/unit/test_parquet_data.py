"""A Parquet file (what Hugging Face datasets ship) reads as its JSON lines equivalent: the same examples, held-out
rows, shuffled passes and refusals (rows named `row N`). Needs pyarrow (the `data` extra)."""

from __future__ import annotations

import itertools
import json

import pyarrow
import pyarrow.parquet
import pytest
import yaml
from bad_jobs import job

from rlfleet.workers import cli
from rlfleet.workers.data import JsonlTask
from rlfleet.workers.data.config import JsonlData

ROWS = [{"question": f"{i}+{i}=", "answer": 2 * i, "source": "gen"} for i in range(8)] + [
    {"question": "Add: 8+8=", "answer": 16, "source": "gen"}]


def write_both(tmp_path, rows):
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    parquet = tmp_path / "data.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), parquet)
    return str(jsonl), str(parquet)


def content(examples):
    return [(e.prompt, e.answer, e.messages) for e in examples]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_parquet_file_reads_as_its_jsonl_equivalent(tmp_path, shuffle):
    jsonl, parquet = write_both(tmp_path, ROWS)
    options = {"prompt_field": "question", "held_out": 2, "shuffle": shuffle, "shuffle_seed": 5}
    lines, rows = JsonlTask(JsonlData(path=jsonl, **options)), JsonlTask(JsonlData(path=parquet, **options))
    assert content(rows.held_out()) == content(lines.held_out()) == [("7+7=", "14", []), ("Add: 8+8=", "16", [])]
    assert content(itertools.islice(rows.train(), 20)) == content(itertools.islice(lines.train(), 20))
    assert [e.id for e in rows.held_out()] == ["row-8", "row-9"]


def test_a_parquet_chat_column_is_a_chat(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": f"{i}+1="}], "answer": i + 1}
            for i in range(3)]
    jsonl, parquet = write_both(tmp_path, rows)
    lines, rows = (JsonlTask(JsonlData(path=p, template="chat")) for p in (jsonl, parquet))
    assert content(itertools.islice(rows.train(), 3)) == content(itertools.islice(lines.train(), 3))
    assert next(rows.train()).messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "0+1="}]


def test_validate_refuses_a_bad_parquet_row_naming_it(tmp_path):
    _, parquet = write_both(tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "Half?", "answer": "\\frac12"}])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(data={"type": "jsonl", "path": parquet})))
    with pytest.raises(SystemExit) as refused:
        cli.main(["validate", str(tmp_path / "job.yaml")])
    assert f"{parquet} row 2: field 'answer' is '\\\\frac12', not a plain number" in str(refused.value.code)


def test_a_file_named_parquet_that_is_not_is_refused(tmp_path):
    (tmp_path / "data.parquet").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="not a Parquet file .*: name JSON lines other than \\*.parquet"):
        JsonlTask(JsonlData(path=str(tmp_path / "data.parquet")))


def test_a_parquet_uri_is_read_as_parquet_once_fetched(tmp_path, monkeypatch):
    from rlfleet.workers.data import tasks

    _, parquet = write_both(tmp_path, ROWS)
    fetched = []
    monkeypatch.setattr(tasks, "fetched_file", lambda uri, cache: fetched.append(uri) or tasks.Path(parquet))
    task = JsonlTask(JsonlData(uri="hf://datasets/owner/sums/data/train-00000-of-00001.parquet",
                               prompt_field="question", held_out=1))
    assert fetched == ["hf://datasets/owner/sums/data/train-00000-of-00001.parquet"]
    assert content(task.held_out()) == [("Add: 8+8=", "16", [])]


def test_a_rows_other_columns_reach_the_scorer_as_json_values(tmp_path):
    """A row's fields travel as JSON (the Score request's fields_json): a timestamp column arrives as its string."""
    import datetime

    stamp = datetime.datetime(2026, 11, 26, 12, 0)
    rows = [{"question": f"{i}+1=", "answer": i + 1, "tests": [i, i + 1], "at": stamp} for i in range(3)]
    path = tmp_path / "data.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    example = next(JsonlTask(JsonlData(path=str(path), prompt_field="question", held_out=1)).train())
    assert example.fields == {"tests": [0, 1], "at": str(stamp)}
    assert json.loads(json.dumps(example.fields)) == example.fields
