"""The image's install without Docker: the build context the Dockerfile copies (after .dockerignore) is built
into a wheel with pip, as the build stage does, installed into a fresh environment, and the commands the image,
the chart and the operator run are started from that install with the image's environment, in its working
directory.

Unproven: the base image, apt packages and the resolution of the dependencies (the fresh environment borrows
this checkout's installed dependencies), vllm, the CUDA variant, a real `docker build` and run, and running as
uid 1000 itself (this checkout's interpreter lives under /root, which only root may enter).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import make_full_job
from dockerfile import REPO, build_stage_copies, dockerignore_patterns, ignored, stage
from helm_tool import template
from rlfleet.operator.workload import build_statefulset, planned_command
from rlfleet.workers.plan import ROLES

pytestmark = pytest.mark.integration


def image_user() -> tuple[int, int]:
    (user,) = [args for name, args in stage(-1) if name == "USER"]
    uid, gid = user.split(":")
    return int(uid), int(gid)


def copy_context(source: Path, dest: Path, relative: str, patterns: list[str]) -> None:
    """COPY source dest, leaving out what .dockerignore keeps out of the build context."""
    if source.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest)
        return
    for path in sorted(source.rglob("*")):
        inside = f"{relative}/{path.relative_to(source).as_posix()}"
        if path.is_file() and not ignored(inside, patterns):
            target = dest / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def run_like_the_image(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def image():
    """(venv, environment, working directory) of an install made like the image's."""
    root = Path(tempfile.mkdtemp(prefix="rlfleet-image-"))
    try:
        src, wheels, venv, home = root / "src", root / "wheels", root / "opt-venv", root / "tmp"
        patterns = dockerignore_patterns()
        for source, dest in build_stage_copies():
            assert not ignored(source.rstrip("/"), patterns), f"COPY {source}: excluded by .dockerignore"
            copy_context(REPO / source, src / dest, source.rstrip("/"), patterns)
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                "--no-index", "-w", str(wheels), str(src)], capture_output=True, text=True,
                               timeout=300)
        assert built.returncode == 0, f"the build stage's pip install would fail:\n{built.stdout}{built.stderr}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                                    "--no-deps", "--no-index", *map(str, wheels.glob("*.whl"))],
                                   capture_output=True, text=True, timeout=300)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        # The dependencies come from this checkout's environment: a path, not a site dir, so its .pth files
        # (the editable install of this checkout) are not run and `rlfleet` comes from the wheel alone.
        site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
        (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
        home.mkdir()
        env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home), "PYTHONUNBUFFERED": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "RLFLEET_CACHE": str(home / "cache")}
        yield venv, env, home
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_rlfleet_comes_from_the_wheel_with_every_module(image):
    venv, env, workdir = image
    probe = ("import pathlib, rlfleet.workers, rlfleet.operator, rlfleet.benchmarks, rlfleet.v1; "
             "print(pathlib.Path(rlfleet.workers.__file__).parents[1])")
    done = run_like_the_image(["python", "-c", probe], env, workdir)
    assert done.returncode == 0, done.stderr
    installed = Path(done.stdout.strip())
    assert installed.is_relative_to(venv), f"rlfleet was imported from {installed}, not the image's install"
    for folder, package in (("workers", "workers"), ("operator", "operator"), ("benchmarks", "benchmarks"),
                            ("proto/rlfleet/v1", "v1")):
        wanted = {p.relative_to(REPO / folder) for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts}
        have = {p.relative_to(installed / package) for p in (installed / package).rglob("*.py")}
        assert wanted <= have, f"missing from the install: {sorted(map(str, wanted - have))[:10]}"


def test_the_images_commands_start_from_the_install(image):
    """CMD, every worker command the operator plans, and the chart's operator command: each answers --help."""
    venv, env, workdir = image
    (cmd,) = [args for name, args in stage(-1) if name == "CMD"]
    deployment = next(d for d in template() if d["kind"] == "Deployment")
    commands = [yaml.safe_load(cmd), deployment["spec"]["template"]["spec"]["containers"][0]["command"] + ["--help"]]
    commands += [planned_command(make_full_job(), role) + ["--help"] for role in ROLES]
    for command in commands:
        done = run_like_the_image(command, env, workdir)
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-3000:]}"
        assert "usage:" in done.stdout, command


def test_the_chart_and_the_workers_run_as_the_images_user():
    uid, gid = image_user()
    deployment = next(d for d in template() if d["kind"] == "Deployment")
    contexts = [deployment["spec"]["template"]["spec"]["securityContext"]]
    job = make_full_job()  # every executor kind
    contexts += [build_statefulset(job, role)["spec"]["template"]["spec"]["securityContext"] for role in ROLES]
    for context in contexts:
        assert (context["runAsUser"], context.get("runAsGroup", gid)) == (uid, gid), context
