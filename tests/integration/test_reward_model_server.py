"""The reward model served as the Scorer on a loopback port: its scores are the model's own, a model that fails
scores 0 and counts the failure, bad requests are refused."""

from __future__ import annotations

import math
import socket
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlfleet.v1 import scorer_pb2, scorer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.reward_model.config import ERROR_NAME
from rlfleet.workers.reward_model.model import RewardModel
from rlfleet.workers.reward_model.server import serve_reward_model
from rlfleet.workers.reward_model.toy import build_reward_model
from rlfleet.workers.spec import parse_job


pytestmark = pytest.mark.integration
TOKEN = new_token()
# Of different lengths, so that a batch pads them; one prompt is long enough to be truncated at maxLength 16.
PAIRS = [("1+2=", "3"), ("9+9=", "18"), ("4+4=", ""), ("what is 7+1? ", "eight, I think"), ("0+0=", "0")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reward-model")
    build_reward_model(directory, seed=3)
    return directory


def job_for(model_dir, **fields):
    return parse_job({"metadata": {"name": "t"}, "spec": {"roles": {"rewardModel": {
        "path": str(model_dir), "batchSize": 2, "maxLength": 16, **fields}}}})


class Served:
    def __init__(self, job, model):
        self.metrics = WorkerMetrics("reward", job="t")
        self.address = f"127.0.0.1:{_free_port()}"
        self.server, self.service = serve_reward_model(job, model, int(self.address.split(":")[1]), "127.0.0.1",
                                                       self.metrics, token=TOKEN)
        wire.wait_ready(self.address, timeout=30)
        self.channel = wire.channel(self.address, TOKEN)

    def score(self, pairs, job_id="t", timeout=60):
        items = [scorer_pb2.ScoreItem(sample_id=str(n), prompt=p, completion=c, answer="x")
                 for n, (p, c) in enumerate(pairs)]
        return scorer_pb2_grpc.ScorerStub(self.channel).Score(scorer_pb2.ScoreRequest(job_id=job_id, items=items),
                                                              timeout=timeout)

    def metric(self, name, **labels):
        for family in text_string_to_metric_families(generate_latest(self.metrics.registry).decode()):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        return None

    def close(self):
        self.channel.close()
        self.server.stop(None).wait(10)
        self.service.close()


@pytest.fixture
def serve():
    started = []

    def start(job, model):
        started.append(Served(job, model))
        return started[-1]

    yield start
    for served in started:
        served.close()


def direct_scores(model_dir, texts, max_length=16):
    """Each text alone (no batch, no padding) through the model as transformers loads it; one character is one
    token, so the last `max_length` characters are what a model reading that many tokens sees."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        return [model(**tokenizer(text[-max_length:], return_tensors="pt")).logits[0, 0].item() for text in texts]


def test_scores_are_a_direct_forward_of_the_model_in_batches(model_dir, serve):
    served = serve(job_for(model_dir), RewardModel(model_dir, max_length=16))
    reply = served.score(PAIRS)
    assert reply.job_id == "t" and [s.sample_id for s in reply.scores] == ["0", "1", "2", "3", "4"]
    assert all(not s.errors for s in reply.scores)
    expected = direct_scores(model_dir, [p + c for p, c in PAIRS])
    assert [s.reward for s in reply.scores] == pytest.approx(expected, abs=1e-4)
    assert len(set(round(s.reward, 4) for s in reply.scores)) == len(PAIRS), "an untrained model scores alike"
    assert served.metric("rlfleet_scored_items_total") == len(PAIRS)
    assert served.metric("rlfleet_busy_seconds_total", role="reward") > 0
    assert served.metric("rlfleet_scorer_errors_total", scorer=ERROR_NAME) == 0


def test_the_chat_template_is_the_reward_models_own(model_dir, serve):
    served = serve(job_for(model_dir, template="chat", maxLength=64), RewardModel(model_dir, template="chat"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                           tokenize=False) for p, c in PAIRS[:2]]
    assert texts[0] == "user: 1+2=\nassistant: 3\n"
    reply = served.score(PAIRS[:2])
    assert [s.reward for s in reply.scores] == pytest.approx(direct_scores(model_dir, texts, 64), abs=1e-4)


class FailsFirst:
    """The real model, but its first `failures` forwards raise (a CUDA out-of-memory, say)."""

    def __init__(self, model, failures=1):
        self.model, self.failures = model, failures

    def score(self, items):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("CUDA out of memory")
        return self.model.score(items)


def test_a_forward_that_raises_scores_its_batch_0_and_counts_the_error(model_dir, serve):
    model = RewardModel(model_dir, max_length=16)
    served = serve(job_for(model_dir), FailsFirst(model))
    reply = served.score(PAIRS[:4])
    assert [s.reward for s in reply.scores[:2]] == [0.0, 0.0]
    assert [list(s.errors) for s in reply.scores] == [[ERROR_NAME], [ERROR_NAME], [], []]
    assert [s.reward for s in reply.scores[2:]] == pytest.approx(model.score(PAIRS[2:4]), abs=1e-5)
    assert served.service.error_counts == {ERROR_NAME: 2}
    assert served.metric("rlfleet_scorer_errors_total", scorer=ERROR_NAME) == 2
    again = served.score(PAIRS[:2])  # the server goes on
    assert all(not s.errors for s in again.scores)


class Answers:
    def __init__(self, values, seconds=0.0):
        self.values, self.seconds = values, seconds
        self.release = threading.Event()

    def score(self, items):
        if self.seconds:
            self.release.wait(self.seconds)
        return self.values[:len(items)]


def test_a_score_that_is_not_a_number_is_0_and_an_error(model_dir, serve):
    served = serve(job_for(model_dir), Answers([math.nan, 0.5]))
    reply = served.score(PAIRS[:2])
    assert [(s.reward, list(s.errors)) for s in reply.scores] == [(0.0, [ERROR_NAME]), (0.5, [])]
    assert served.service.error_counts == {ERROR_NAME: 1}


def test_a_forward_past_its_budget_scores_0_and_the_request_still_answers(model_dir, serve):
    slow = Answers([1.0, 1.0], seconds=60)
    served = serve(job_for(model_dir, timeoutSeconds=0.05), slow)
    try:
        reply = served.score(PAIRS[:3], timeout=30)  # two batches, budgets of 0.1 s and 0.05 s
    finally:
        slow.release.set()
    assert [(s.reward, list(s.errors)) for s in reply.scores] == [(0.0, [ERROR_NAME])] * 3
    assert served.service.error_counts == {ERROR_NAME: 3}
    deadline = time.monotonic() + 30
    while (reply := served.score(PAIRS[:1])).scores[0].errors and time.monotonic() < deadline:
        time.sleep(0.1)  # the stuck forward is released; the next batch is scored
    assert [(s.reward, list(s.errors)) for s in reply.scores] == [(1.0, [])]


@pytest.mark.parametrize("pairs, job_id", [
    (PAIRS[:1], "other-job"),
    ([], "t"),
    ([("", "")] * 65537, "t"),
    ([("", "x" * ((1 << 20) + 1))], "t"),
], ids=["wrong-job", "empty", "too-many-items", "item-too-large"])
def test_refuses_bad_requests_and_keeps_serving(model_dir, serve, pairs, job_id):
    served = serve(job_for(model_dir), RewardModel(model_dir, max_length=16))
    with pytest.raises(grpc.RpcError) as refused:
        served.score(pairs, job_id=job_id)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    health = health_pb2_grpc.HealthStub(served.channel)
    name = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name
    assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert not served.score(PAIRS[:1]).scores[0].errors
    assert served.service.error_counts == {ERROR_NAME: 0}


def test_a_classifier_with_several_labels_is_refused(tmp_path):
    build_reward_model(tmp_path, labels=2)
    with pytest.raises(ValueError, match="num_labels 1"):
        RewardModel(tmp_path)
