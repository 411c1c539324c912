"""Environments of the user's own (`type: python`): the class a job names, loaded and played for whole episodes, and
every way the class can fail to load, refused before any worker starts (by importing it where the job runs, by
reading it without running it where the operator checks it)."""

from __future__ import annotations

import json
from pathlib import Path

import kopf
import pytest
import yaml

from rlfleet.operator import handlers
from rlfleet.operator.policy import PodPolicy
from rlfleet.workers import cli
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.environment.config import OpenEnvEnvironment, PythonEnvironment
from rlfleet.workers.environment.loading import (environment_import_problems, environment_source_problems,
                                                 load_environment, with_environment_source)
from rlfleet.workers.spec import MAX_SOURCES_JSON_BYTES, SpecError, parse_job

from conftest import make_job

GUESS = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "guess" / "guess_env.py"
WHERE = "spec.roles.environment"


def guess(**fields) -> PythonEnvironment:
    return PythonEnvironment(path=str(GUESS), source=GUESS.read_text(), class_name="Guess", **fields)


def example(answer: str) -> Example:
    return Example(id="0", prompt="", answer=answer)


def test_the_guess_example_plays_a_whole_episode():
    environment = load_environment(guess(kwargs={"high": 50, "cost": 0.25}))()
    [opening] = environment.reset(example("37"))
    assert opening["role"] == "user" and "from 1 to 50" in opening["content"]
    replies = [("I say 20", "20 is wrong: higher."), ("40", "40 is wrong: lower."), ("hmm", "Answer with a number.")]
    for reply, answer in replies:
        step = environment.step(reply)
        assert step.messages == [{"role": "user", "content": answer}] and not step.done and step.reward == 0.0
    final = environment.step("37")
    assert final.done and final.messages == [] and final.reward == pytest.approx(1.0 - 2 * 0.25)


def test_each_episode_gets_an_instance_of_its_own(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(GUESS.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    make = load_environment(PythonEnvironment(module="my_envs", class_name="Guess"))
    first, second = make(), make()
    first.reset(example("3"))
    second.reset(example("9"))
    assert first is not second
    assert first.step("3").done and not second.step("3").done


def test_the_file_is_read_into_source_or_refused_naming_the_field(tmp_path):
    spec, problems = with_environment_source(PythonEnvironment(path=str(GUESS), class_name="Guess"))
    assert spec.source == GUESS.read_text() and problems == []
    _, [problem] = with_environment_source(PythonEnvironment(path=str(tmp_path / "gone.py"), class_name="Guess"))
    assert problem.startswith(f"{WHERE}.path {str(tmp_path / 'gone.py')!r}: No such file or directory")


@pytest.mark.parametrize("source, name, expected", [
    ("", "Guess", f"{WHERE}.path: AttributeError: "),
    ("Guess = 3\n", "Guess", f"{WHERE}.path: TypeError: 'Guess' in "),
    ("class Guess:\n    pass\n", "Guess", f"{WHERE}.path: TypeError: 'Guess' in "),
    ("import no_such_module_here\n", "Guess", f"{WHERE}.path: ModuleNotFoundError: "),
    ("class Guess(:\n", "Guess", f"{WHERE}.path: SyntaxError: "),
    ("import os\nos._exit(0)\n", "Guess", f"{WHERE}.path: "),
])
def test_a_class_that_does_not_load_is_refused(tmp_path, source, name, expected):
    path = tmp_path / "env.py"
    path.write_text(source)
    [problem] = environment_import_problems(PythonEnvironment(path=str(path), source=source, class_name=name))
    assert problem.startswith(expected)


def test_a_loadable_class_passes_both_checks():
    assert environment_import_problems(guess()) == [] and environment_source_problems(guess()) == []
    assert environment_import_problems(None) == [] and environment_source_problems(None) == []


@pytest.mark.parametrize("source, expected", [
    (None, f"{WHERE}.source: missing: the pods cannot read"),
    ("class Guess(:\n", f"{WHERE}.source: does not parse: "),
    ("class Other:\n    pass\n", f"{WHERE}.source: defines no 'Guess' at the top level: define `class Guess("),
])
def test_the_operator_refuses_without_running_the_code(tmp_path, source, expected):
    sentinel = tmp_path / "ran"
    spec = PythonEnvironment(path="env.py", class_name="Guess",
                             source=source and f"open({str(sentinel)!r}, 'w')\n{source}")
    [problem] = environment_source_problems(spec)
    assert problem.startswith(expected)
    assert not sentinel.exists()


def test_the_operator_refuses_a_job_whose_environment_does_not_define_its_class(monkeypatch):
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: None)
    environment = {"type": "python", "path": "env.py", "class": "Guess", "source": "class Other:\n    pass\n"}
    body = kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
                      "metadata": {"name": "guess", "namespace": "default", "uid": "u", "generation": 1},
                      "spec": {"roles": {"environment": environment}}})
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError):
        handlers.load_or_refuse(body, body.status, patch, PodPolicy())
    [condition] = patch.status["conditions"]
    assert condition["reason"] == "InvalidSpec"
    assert condition["message"].startswith(f"{WHERE}.source: defines no 'Guess' at the top level")


def test_validate_and_render_carry_the_source_and_refuse_a_missing_class(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "guess_env.py").write_text(GUESS.read_text())
    environment = {"type": "python", "path": "guess_env.py", "class": "Guess"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"metadata": {"name": "guess"},
                                                       "spec": {"roles": {"environment": environment}}}))
    assert cli.main(["validate", "job.yaml"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["roles"]["environment"]["source"] == GUESS.read_text()
    (tmp_path / "guess_env.py").write_text("class Other:\n    pass\n")
    for command in ("validate", "render"):
        with pytest.raises(SystemExit) as refused:
            cli.main([command, "job.yaml"])
        assert f"{WHERE}." in str(refused.value.code) and "no 'Guess'" in str(refused.value.code)


@pytest.mark.parametrize("environment, field", [
    ({"type": "python", "class": "Guess"}, f"{WHERE}.python: Value error, give exactly one of path"),
    ({"type": "python", "path": "a.py", "module": "a", "class": "Guess"},
     f"{WHERE}.python: Value error, give exactly one of path"),
    ({"type": "python", "path": "a.py"}, f"{WHERE}.python.class: Field required"),
    ({"type": "python", "path": "a.py", "class": "a b"}, f"{WHERE}.python.class: String should match pattern"),
    ({"type": "python", "path": "a.py", "class": "G", "source": "#" * (300 * 1024)},
     f"{WHERE}.python.source: Value error, 307200"),
])
def test_the_schema_refuses_what_cannot_work(environment, field):
    with pytest.raises(SpecError) as refused:
        parse_job({"metadata": {"name": "j"}, "spec": {"roles": {"environment": environment}}})
    assert refused.value.problems[0].startswith(field)


def test_the_environments_source_counts_toward_the_configmap():
    source = "#" * (200 * 1024)
    scorers = [{"type": "python", "path": f"r{i}.py", "source": source} for i in range(3)]
    make_job(scorers=scorers)  # 600 KiB fit
    with pytest.raises(SpecError) as refused:
        make_job(scorers=scorers, roles={"environment": {"type": "python", "path": "e.py", "class": "E",
                                                         "source": source}})
    assert f"at most {MAX_SOURCES_JSON_BYTES}" in refused.value.problems[0]


def test_an_in_process_openenv_class_travels_and_is_checked_like_a_python_environment(tmp_path):
    (tmp_path / "server.py").write_text("class Other:\n    pass\n")
    spec = OpenEnvEnvironment(in_process={"path": str(tmp_path / "server.py"), "class": "Echo", "action": "Say"})
    filled, problems = with_environment_source(spec)
    assert problems == [] and filled.in_process.source == "class Other:\n    pass\n" and filled.url is None
    [problem] = environment_source_problems(filled)
    assert problem.startswith(f"{WHERE}.inProcess.source: defines no 'Echo' at the top level: define `class Echo(")
    [problem] = environment_source_problems(spec)
    assert problem.startswith(f"{WHERE}.inProcess.source: missing")
    assert environment_source_problems(OpenEnvEnvironment(url="http://127.0.0.1:8000")) == []


@pytest.mark.parametrize("environment", [
    {"type": "openenv"},
    {"type": "openenv", "url": "http://e:8000", "inProcess": {"module": "e", "class": "E", "action": "A"}},
])
def test_an_openenv_environment_is_a_server_or_a_class(environment):
    with pytest.raises(SpecError) as refused:
        parse_job({"metadata": {"name": "j"}, "spec": {"roles": {"environment": environment}}})
    assert refused.value.problems[0].startswith(f"{WHERE}.openenv: Value error, give exactly one of url")
