"""`rlfleet run` refuses, before any worker starts, what would only fail in a worker: a file path that is not there
(relative ones taken from where it runs, since its workers run in the run directory), data the controller could not
read, a tensor-parallel size that does not divide the model's kv heads."""

from __future__ import annotations

import json

import pytest
import yaml

from rlfleet.workers import cli, local
from rlfleet.workers.storage import fetch

from conftest import make_full_job

REWARD = {"roles": {"rewardModel": {"path": "runs/toy-reward-model"}}}
DATA = {"data": {"type": "jsonl", "path": "data/train.jsonl"}}


@pytest.fixture
def started(tmp_path, monkeypatch) -> list:
    """`rlfleet run` in tmp_path up to run_local: the jobs it would start."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fetch, "fetch_for", lambda *args: None)
    model = tmp_path / "model"  # what materialize made: a GQA model, 4 query heads and 1 kv head of 32
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 1,
                                                   "hidden_size": 128, "vocab_size": 100}))
    monkeypatch.setattr("rlfleet.workers.models.materialize", lambda *args: model)
    jobs = []
    monkeypatch.setattr(local, "run_local", lambda job, out: jobs.append(job) or 0)
    return jobs


def _run(tmp_path, **spec) -> int:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(make_full_job(**spec).to_dict()))
    return cli.main(["run", "job.yaml", "--out", "runs/out"])


@pytest.mark.parametrize("spec, field, path", [(REWARD, "spec.roles.rewardModel.path", "runs/toy-reward-model"),
                                               (DATA, "spec.data.path", "data/train.jsonl")])
def test_a_path_that_is_not_there_is_refused_before_any_worker_starts(tmp_path, started, spec, field, path):
    with pytest.raises(SystemExit) as refused:
        _run(tmp_path, **spec)
    assert f"{field} '{tmp_path / path}': no such file or directory" in str(refused.value.code)
    assert started == []


def test_relative_paths_are_taken_from_where_rlfleet_run_runs(tmp_path, started):
    """The every-executor example's rewardModel.path: its workers, in the run directory, must find it too."""
    (tmp_path / "runs" / "toy-reward-model").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n')
    assert _run(tmp_path, **REWARD, **DATA) == 0
    [job] = started
    assert job.spec.roles.reward_model.path == str(tmp_path / "runs" / "toy-reward-model")
    assert job.spec.data.path == str(tmp_path / "data" / "train.jsonl")


def test_a_data_line_the_controller_could_not_read_is_refused(tmp_path, started):
    """It failed in the controller's start, a traceback in a worker log while the other workers kept waiting."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n')
    with pytest.raises(SystemExit) as refused:
        _run(tmp_path, roles={"rewardModel": None}, **DATA)
    assert "train.jsonl line 2: missing field 'answer'" in str(refused.value.code)
    assert started == []


def test_a_tensor_parallel_size_above_the_kv_heads_is_refused(tmp_path, started):
    """vLLM would replicate the kv head on both ranks; the weight sync's plan would split it, and the first push
    would fail."""
    with pytest.raises(SystemExit) as refused:
        _run(tmp_path, roles={"rewardModel": None, "generator": {"tensorParallelSize": 2}})
    message = str(refused.value.code)
    assert "spec.roles.generator.tensorParallelSize 2 must divide" in message and "kv heads (1)" in message, message
    assert started == []


REWARDS = "def score(completion, answer, prompt, **fields):\n    return float(completion == answer)\n"


def _with_rewards(tmp_path, source: str | None = REWARDS, **scorer) -> dict:
    if source is not None:
        (tmp_path / "rewards.py").write_text(source)
    return {"roles": {"rewardModel": None}, "scorers": [{"type": "python", "path": "rewards.py", **scorer}]}


@pytest.mark.parametrize("source, scorer, problem", [
    (None, {}, "spec.scorers.0.path 'rewards.py': No such file or directory"),
    (REWARDS, {"function": "reward"}, "spec.scorers.0.path: AttributeError: rewards.py defines no 'reward': define"),
    ("import no_such_package_xyz\n" + REWARDS, {}, "spec.scorers.0.path: ModuleNotFoundError: No module named"),
])
def test_reward_code_that_does_not_load_is_refused_before_any_worker_starts(tmp_path, started, source, scorer,
                                                                            problem):
    with pytest.raises(SystemExit) as refused:
        _run(tmp_path, **_with_rewards(tmp_path, source, **scorer))
    assert problem in str(refused.value.code)
    assert started == []


def test_the_reward_file_travels_in_the_job_as_its_source(tmp_path, started):
    """The run's config.json (and so a resume) holds the code as it was at the start, not the file as it is."""
    assert _run(tmp_path, **_with_rewards(tmp_path)) == 0
    [job] = started
    assert job.spec.scorers[0].source == REWARDS and job.spec.scorers[0].path == "rewards.py"


def test_validate_and_render_carry_the_source_and_refuse_a_missing_function(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    job = make_full_job(**_with_rewards(tmp_path), storage={"checkpointClaim": "runs"})  # the controllers share it
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job.to_dict()))
    assert cli.main(["validate", "job.yaml"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["scorers"][0]["source"] == REWARDS
    assert cli.main(["render", "job.yaml"]) == 0
    configmap = next(o for o in yaml.safe_load_all(capsys.readouterr().out) if o["kind"] == "ConfigMap")
    assert json.loads(configmap["data"]["job.json"])["spec"]["scorers"][0]["source"] == REWARDS
    (tmp_path / "rewards.py").write_text("def other(completion, answer, prompt):\n    return 1.0\n")
    for command in ("validate", "render"):
        with pytest.raises(SystemExit) as refused:
            cli.main([command, "job.yaml"])
        assert "spec.scorers.0." in str(refused.value.code) and "no 'score'" in str(refused.value.code)
