"""No Docker engine runs here: check what can be checked without one. The Dockerfile parses, both variants
are handled, it ends as a non-root user, and every command the chart and the operator run exists."""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from conftest import make_job
from rlfleet.operator.workload import planned_command
from rlfleet.workers.cli import ROLE_MAINS, _parser
from rlfleet.workers.plan import ROLES

REPO = Path(__file__).resolve().parents[2]
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "LABEL", "CMD", "ENTRYPOINT", "EXPOSE"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def test_dockerfile_parses_into_known_instructions():
    parsed = instructions()
    assert parsed and all(name in INSTRUCTIONS for name, _ in parsed)
    assert parsed[0][0] in ("ARG", "FROM")
    assert sum(name == "FROM" for name, _ in parsed) == 2  # build stage and a slim runtime stage


def test_both_variants_are_built_by_argument():
    run = next(args for name, args in instructions() if name == "RUN" and "VARIANT" in args)
    assert "cpu)" in run and "cuda)" in run
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in re.findall(r"\.\[([a-z0-9,$]+)\]", run)[0].replace("$extra", "cpu,gpu").split(","):
        assert extra in extras, f"extra [{extra}] is not in pyproject.toml"
    for constraint in ("cpu", "gpu"):
        assert (REPO / "constraints" / f"{constraint}.txt").exists()


def test_image_runs_as_a_numeric_non_root_user():
    users = [args for name, args in instructions() if name == "USER"]
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    # The same uid the worker pods and the operator Deployment run as.
    from rlfleet.operator.workload import USER_ID
    assert int(uid) == USER_ID
    assert "runAsUser: 1000" in (REPO / "charts/rlfleet/templates/deployment.yaml").read_text()


def test_copied_sources_exist():
    for name, args in instructions():
        if name == "COPY" and "--from" not in args:
            for source in shlex.split(args)[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


@pytest.mark.parametrize("role", ROLES)
def test_worker_commands_exist(role):
    command = planned_command(make_job(), role)
    assert command[:2] == ["rlfleet", "worker"] and command[2] in ROLE_MAINS
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rlfleet"] == "rlfleet.workers.cli:main"
    assert _parser().parse_args(command[1:]).role == role


def test_operator_command_exists():
    deployment = (REPO / "charts/rlfleet/templates/deployment.yaml").read_text()
    assert 'command: ["python", "-m", "rlfleet.operator"]' in deployment
    assert importlib.util.find_spec("rlfleet.operator.__main__") is not None
