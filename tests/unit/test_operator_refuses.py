"""The operator's reconcile handler refuses every bad job of the corpus (tests/bad_jobs.py) that a Kubernetes API
server would store: a permanent error (kopf does not retry), a Failed status whose Ready condition says
InvalidSpec, a Warning event naming the field path, and not one call to the API.

The whole corpus runs here, against the handler function; tests/integration/test_operator_kopf.py sends it
through kopf and KMock too.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from bad_jobs import kubernetes_objects

from rlfleet.operator import handlers
from rlfleet.operator.compat import Server
from rlfleet.operator.config import OperatorConfig

CASES = kubernetes_objects()


class NoApi:
    """The Kubernetes client of a refused job: any use is a failure."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a refused job used the API ({name})")


@pytest.mark.parametrize("name, spec, path", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_reconcile_refuses_the_job_naming_the_field(monkeypatch, name, spec, path):
    events = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: events.append((body.meta["name"], reason, message)))
    body = kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
                      "metadata": {"name": name, "namespace": "default", "uid": "u", "generation": 1},
                      "spec": spec})
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError) as refused:
        await handlers.reconcile(body=body, status=body.status, patch=patch,
                                 memo=kopf.Memo(kube=NoApi(), config=OperatorConfig(), server=Server()),
                                 logger=logging.getLogger("test"))
    assert f"{path}: " in str(refused.value)
    assert patch.status["phase"] == "Failed"
    [condition] = patch.status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == ("Ready", "False", "InvalidSpec")
    assert condition["message"].startswith(f"{path}: ") or f"; {path}: " in condition["message"]
    [(event_object, reason, message)] = events
    assert (event_object, reason) == (name, "InvalidSpec")
    assert f"{path}: " in message and len(message) <= 1024


async def test_a_valid_job_is_not_refused():
    """The same call with a good spec gets past validation (to the API): the refusals above are the spec's."""
    body = kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
                      "metadata": {"name": "good", "namespace": "default", "uid": "u"}, "spec": {}})
    with pytest.raises(AssertionError, match="a refused job used the API"):
        await handlers.reconcile(body=body, status=body.status, patch=kopf.Patch(),
                                 memo=kopf.Memo(kube=NoApi(), config=OperatorConfig(), server=Server()),
                                 logger=logging.getLogger("test"))


@pytest.mark.parametrize("scorer, problem", [
    ({"type": "python", "path": "rewards.py"}, "spec.scorers.0.source: missing: the pods cannot read 'rewards.py'"),
    ({"type": "python", "path": "rewards.py", "source": "def scored(completion, answer, prompt):\n    return 1\n"},
     "spec.scorers.0.source: defines no 'score' at the top level"),
    ({"type": "python", "path": "rewards.py", "source": "def score(:\n"}, "spec.scorers.0.source: does not parse"),
])
async def test_reward_code_the_pods_could_not_load_is_refused(monkeypatch, scorer, problem):
    """Found without running the code (tests/unit/test_python_scorer.py): a Failed status, an InvalidSpec event."""
    events = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: events.append((reason, message)))
    body = kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
                      "metadata": {"name": "rewards", "namespace": "default", "uid": "u", "generation": 1},
                      "spec": {"scorers": [{"type": "math_answer"}, scorer]}})
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError):
        await handlers.reconcile(body=body, status=body.status, patch=patch,
                                 memo=kopf.Memo(kube=NoApi(), config=OperatorConfig(), server=Server()),
                                 logger=logging.getLogger("test"))
    problem = problem.replace("scorers.0", "scorers.1")
    [condition] = patch.status["conditions"]
    assert condition["reason"] == "InvalidSpec" and condition["message"].startswith(problem)
    [(reason, message)] = events
    assert reason == "InvalidSpec" and message.startswith(problem)
