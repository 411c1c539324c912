"""Generators added to and removed from a running job: the controller's side (which replicas are in the rotation,
what a removed replica's batch keeps), the endpoints file it follows, and how both runtimes write that file."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fleet_fakes import DiesOnCall, FakeGenerator, make_parts, start_producers, train

from rlfleet.operator.workload import CONFIG_DIR, build_statefulset
from rlfleet.workers.cli import main
from rlfleet.workers.controller.members import GeneratorMembers
from rlfleet.workers.controller.rollouts import Stopped
from rlfleet.workers.local import CONFIG_FILE, write_config
from rlfleet.workers.plan import (
    ENDPOINTS_FILE,
    ENDPOINTS_FILE_ENV,
    cluster_endpoints,
    local_endpoints,
    local_ports,
    plan_workers,
)
from rlfleet.workers.spec import parse_job

from conftest import make_job


def _claimed(dispatch, replica: int, seconds: float = 0.3) -> bool:
    """Whether `replica` gets a batch within `seconds` (the claim is abandoned after)."""
    got = threading.Event()

    def claim() -> None:
        try:
            dispatch.claim(replica)
            got.set()
        except Stopped:
            pass

    threading.Thread(target=claim, daemon=True).start()
    return got.wait(seconds)


def test_an_added_replica_gets_work_only_once_it_joined(tmp_path):
    parts, _ = make_parts(make_job(algorithm={"steps": 5}), tmp_path, [FakeGenerator()])
    dispatch = parts.dispatch
    dispatch.replicas.resize({0, 1})
    assert dispatch.replicas.members() == [0, 1] and dispatch.replicas.down() == [1] and dispatch.replicas.up() == [0]
    assert not _claimed(dispatch, 1), "a replica that holds no weights yet was given a batch"
    dispatch.replicas.set_up(1, 0)
    assert _claimed(dispatch, 1)
    dispatch.replicas.stop()


def test_a_removed_replica_leaves_the_rotation_and_is_not_probed_again(tmp_path):
    parts, _ = make_parts(make_job(algorithm={"steps": 5}), tmp_path, [FakeGenerator(), FakeGenerator(),
                                                                        FakeGenerator()])
    dispatch = parts.dispatch
    dispatch.replicas.set_down(1)
    dispatch.replicas.resize({0})
    assert dispatch.replicas.up() == [0] and dispatch.replicas.down() == [], "a removed replica would be pushed to or probed"
    assert not _claimed(dispatch, 2)
    dispatch.replicas.resize({0, 1, 2})  # added again: down until it has joined anew
    assert dispatch.replicas.down() == [1, 2]
    dispatch.replicas.stop()


def test_replicas_of_any_pool_come_and_go_and_the_others_keep_their_indexes(tmp_path):
    """Two pools' blocks (0.. and 128..): the first pool grows into its gap and the second shrinks, and every other
    replica keeps its index, its state and its place in the rotation."""
    parts, _ = make_parts(make_job(algorithm={"steps": 5}), tmp_path, [FakeGenerator()])
    replicas = parts.dispatch.replicas
    replicas.resize({0, 128, 129})
    replicas.set_up(128, 0)
    replicas.set_up(129, 0)
    assert replicas.members() == [0, 128, 129] and replicas.up() == [0, 128, 129]
    replicas.resize({0, 1, 128})
    assert replicas.members() == [0, 1, 128] and replicas.up() == [0, 128] and replicas.down() == [1]
    assert not _claimed(parts.dispatch, 129), "a removed replica was given a batch"
    assert not _claimed(parts.dispatch, 1), "a replica that holds no weights yet was given a batch"
    replicas.stop()


def test_a_batch_handed_back_keeps_the_tokens_generated_before(tmp_path):
    """Replica 0 generates one segment of batch 0 and is lost (or removed); replica 1 finishes the batch from
    there instead of starting it over. One prompt a batch: a batch of one group is never split (dispatch.py)."""
    job = make_job(algorithm={"maxStaleness": 1, "steps": 2, "promptsPerStep": 1, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    generators = [DiesOnCall(1, tokens=3), FakeGenerator(tokens=3)]
    parts, fleet = make_parts(job, tmp_path, generators)
    start_producers(parts, generators, [0])
    deadline = time.monotonic() + 10
    while not fleet.marked_down and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fleet.marked_down == [0]
    start_producers(parts, generators, [1])
    (step, batch), _ = train(parts, fleet, range(2))
    assert (step, batch.replica) == (0, 1)
    assert batch.visits == 2, "the batch started over: the lost replica's tokens were dropped"
    assert all(len(r.completion_ids) == 3 for r in batch.rollouts)


def test_the_controller_sees_a_changed_generator_list_once(tmp_path):
    job = make_job(roles={"generator": {"replicas": 2}})
    path = tmp_path / ENDPOINTS_FILE
    members = GeneratorMembers(str(path), cluster_endpoints(job))
    assert members.changed() is None  # no file yet
    path.write_text(cluster_endpoints(job).to_json())
    assert members.changed() is None  # the same generators
    grown = cluster_endpoints(make_job(roles={"generator": {"replicas": 3}}))
    path.write_text(grown.to_json())
    assert members.changed() == grown
    assert members.changed() is None
    path.write_text('{"generators": [')  # half written: ignored until whole
    assert members.changed() is None
    path.write_text(cluster_endpoints(job).to_json())
    assert members.changed().of("generator") == cluster_endpoints(job).of("generator")


def test_added_generators_get_new_ports_and_every_other_worker_keeps_its_own():
    ports = local_ports(make_job(roles={"generator": {"replicas": 1}}))
    grown = local_ports(make_job(roles={"generator": {"replicas": 3}}), given=ports)
    assert all(grown[key] == named for key, named in ports.items() if key != ("trainer", 0))
    assert {k: v for k, v in grown[("trainer", 0)].items() if k in ports[("trainer", 0)]} == ports[("trainer", 0)]
    every = [port for named in grown.values() for port in named.values()]
    assert len(every) == len(set(every)) and {"sync1", "sync2"} <= set(grown[("trainer", 0)])


def test_both_runtimes_tell_the_trainer_where_the_endpoints_file_is(tmp_path):
    job = make_job()
    ports = local_ports(job)
    config = tmp_path / CONFIG_FILE
    workers = plan_workers(job, local_endpoints(job, ports), str(config), str(tmp_path), "token",
                           ports=lambda role, rank: ports[(role, rank)])
    trainer = next(w for w in workers if w.role == "trainer")
    assert trainer.env[ENDPOINTS_FILE_ENV] == str(tmp_path / ENDPOINTS_FILE)
    pod = build_statefulset(job, "trainer")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[ENDPOINTS_FILE_ENV] == f"{CONFIG_DIR}/{ENDPOINTS_FILE}"
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == CONFIG_DIR and "subPath" not in mount, "the kubelet never refreshes a subPath mount"
    assert {"key": "endpoints.json", "path": ENDPOINTS_FILE} in config_volume["items"]


def test_scale_refuses_a_bad_count_and_leaves_the_run_as_it_was(tmp_path, capsys):
    write_config(tmp_path / CONFIG_FILE, make_job())
    before = (tmp_path / CONFIG_FILE).read_text()
    with pytest.raises(SystemExit) as refused:
        main(["scale", str(tmp_path), "--generators", "0"])
    assert "roles.generator.replicas" in str(refused.value)
    assert (tmp_path / CONFIG_FILE).read_text() == before
    assert main(["scale", str(tmp_path), "--generators", "3"]) == 0
    saved = parse_job(json.loads((tmp_path / CONFIG_FILE).read_text()))
    assert saved.spec.roles.generator.replicas == 3
    assert saved.spec.algorithm == make_job().spec.algorithm
