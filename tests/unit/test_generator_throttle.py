"""The benchmark knob that slows one generator replica (RLFLEET_GENERATOR_THROTTLE, `rlfleet bench pools`)."""

from __future__ import annotations

import pytest
from test_generator_staging import StagingEngine

from rlfleet.v1 import generator_pb2
from rlfleet.workers.generator import server
from rlfleet.workers.generator.server import THROTTLE_ENV, GeneratorService, throttle


def test_the_throttle_names_the_replicas_it_slows():
    environ = {THROTTLE_ENV: "1=0.002,3=0.5"}
    assert (throttle(0, environ), throttle(1, environ), throttle(3, environ)) == (0.0, 0.002, 0.5)
    assert throttle(1, {}) == 0.0


@pytest.mark.parametrize("value", ["0.002", "1:0.002", "one=2", "1=-1"])
def test_a_malformed_throttle_says_how_to_write_it(value):
    with pytest.raises(ValueError, match=THROTTLE_ENV):
        throttle(1, {THROTTLE_ENV: value})


def test_a_throttled_replica_sleeps_for_each_token_it_generated(monkeypatch):
    slept = []
    monkeypatch.setattr(server.time, "sleep", slept.append)
    service = GeneratorService("t", StagingEngine(), throttle=0.25)
    request = generator_pb2.GenerateRequest(job_id="t", max_tokens=1, temperature=1.0, top_p=1.0, seed=0,
                                            sequences=[generator_pb2.Sequence(sample_id=s, prompt_ids=[1])
                                                       for s in "abc"])
    service.Generate(request, None)
    assert slept == [0.75]
