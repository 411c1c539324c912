"""The executor table (workers/executors.py) is the one place a kind is registered: each entry matches a section of
spec.roles and a worker entry point that exists, and every package the workers have is in the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

from rlfleet.workers.executors import KINDS, ROLES, worker_main
from rlfleet.workers.plan import DIST_PORT, GRPC_PORT, METRICS_PORT, cluster_port
from rlfleet.workers.spec import Roles

ROOT = Path(__file__).resolve().parents[2]


def test_every_section_of_spec_roles_is_an_executor_kind_and_every_kind_has_one():
    assert sorted(kind.spec_field for kind in KINDS) == sorted(Roles.model_fields)
    # The controller's hosts start last: the trainer, then a controller of its own (which calls the trainer).
    assert len(set(ROLES)) == len(ROLES) and ROLES[-2:] == ("trainer", "control")


def test_every_kind_has_a_worker_entry_point_and_idle_reasons_its_clock_knows():
    for kind in KINDS:
        assert callable(worker_main(kind.role)), kind.main
        assert kind.idle_reasons and len(set(kind.idle_reasons)) == len(kind.idle_reasons), kind.role


def test_every_workers_package_is_in_the_wheel():
    """A package missing from pyproject's list is missing from the image: its pods fail with ModuleNotFoundError
    (seen on the real cluster with rlfleet.workers.storage)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"rlfleet." + str(init.parent.relative_to(ROOT)).replace("/", ".")
             for init in (ROOT / "workers").rglob("__init__.py")}
    assert found - listed == set()


def test_each_receiving_kind_has_a_sync_port_name_and_range_of_its_own():
    """Trainer 0 hosts a sync store per replica of every kind the weights go to: the names must not be read as
    another kind's, nor the port ranges (a replica each, up to the 1024 replicas a role allows) overlap."""
    receiving = [kind for kind in KINDS if kind.receives_weights]
    assert {"generator", "reference"} <= {kind.role for kind in receiving}
    assert all(not kind.sync_port and not kind.sync_port_base for kind in KINDS if not kind.receives_weights)
    for kind in receiving:
        assert kind.sync_port and kind.sync_port.isalpha(), kind.role
        assert cluster_port(f"{kind.sync_port}1023") == kind.sync_port_base + 1023
    taken = [{GRPC_PORT}, {METRICS_PORT}, {DIST_PORT}] + [
        set(range(kind.sync_port_base, kind.sync_port_base + 1024)) for kind in receiving]
    assert sum(len(ports) for ports in taken) == len(set().union(*taken))
