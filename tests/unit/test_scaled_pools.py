"""A generator StatefulSet scaled by hand (`kubectl scale statefulset`, an autoscaler of it): which pools the
operator finds scaled, what the RLJob takes, and what it says when it cannot (operator/scaled.py)."""

from __future__ import annotations

import pytest

from conftest import make_job
from rlfleet.operator.render import build_all
from rlfleet.operator.scaled import REPLICAS_ANNOTATION, refusal, scaled_by_hand, scaled_fields

POOLS = {"pools": [{"name": "fast", "replicas": 2}, {"name": "slow", "replicas": 1}]}


def _sets(job) -> dict:
    """The job's generator StatefulSets as the operator writes them, by pool name."""
    return {o["metadata"]["labels"].get("rlfleet.io/pool", ""): o for o in build_all(job)
            if o["kind"] == "StatefulSet" and o["metadata"]["labels"]["rlfleet.io/role"] == "generator"}


def test_a_statefulset_scaled_by_someone_else_is_found_and_the_operators_own_counts_are_not():
    job = make_job(roles={"generator": POOLS})
    sets = _sets(job)
    assert sets["fast"]["metadata"]["annotations"][REPLICAS_ANNOTATION] == "2"
    assert scaled_by_hand(job, sets) == []
    sets["fast"]["spec"]["replicas"] = 5
    [scaled] = scaled_by_hand(job, sets)
    assert (scaled.index, scaled.pool.name, scaled.replicas) == (0, "fast", 5)
    assert scaled.message() == ("generator pool fast's StatefulSet was scaled to 5: "
                                "spec.roles.generator.pools[0].replicas is 5 now")
    taken = make_job(roles={"generator": {"pools": [{"name": "fast", "replicas": 5}, {"name": "slow"}]}})
    assert scaled_by_hand(taken, sets) == [], "a count the job already holds is taken again"
    del sets["fast"]["metadata"]["annotations"]
    assert scaled_by_hand(job, sets) == [], "an older operator's StatefulSet, whose count is unknown, was taken"
    assert scaled_by_hand(job, {"fast": None}) == []


@pytest.mark.parametrize("stated", [True, False])
def test_the_job_takes_the_count_into_its_pool_and_the_pools_sum(stated):
    job = make_job(roles={"generator": POOLS})
    sets = _sets(job)
    sets["slow"]["spec"]["replicas"] = 4
    generator = {"engine": "torch", **POOLS} | ({"replicas": 3} if stated else {})
    fields = scaled_fields({"roles": {"generator": generator}}, scaled_by_hand(job, sets))
    pools = [{"name": "fast", "replicas": 2}, {"name": "slow", "replicas": 4}]
    assert fields == ({"pools": pools, "replicas": 6} if stated else {"pools": pools})
    assert generator["pools"][1]["replicas"] == 1, "the stored spec was changed in place"


def test_a_job_without_pools_takes_the_count_into_its_replicas():
    job = make_job(roles={"generator": {"replicas": 2}})
    sets = _sets(job)
    sets[""]["spec"]["replicas"] = 3
    [scaled] = scaled_by_hand(job, sets)
    assert scaled.field == "spec.roles.generator.replicas"
    assert scaled_fields({"roles": {"generator": {"replicas": 2}}}, [scaled]) == {"replicas": 3}
    assert refusal(["spec.roles.generator.replicas: too many"], [scaled]) == (
        "spec.roles.generator.replicas: too many: spec.roles.generator.replicas stays 2 (its StatefulSet is scaled "
        "back)")
