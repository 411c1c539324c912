"""A trainer pod whose memory limit is clearly too small for its model is refused at start, naming the field; without
microBatchTokens, micro-batches are sized from free memory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from types import SimpleNamespace

from rlfleet.workers.trainer.memory import (GIB, MAX_TOKENS, MIN_TOKENS, NotEnoughMemory, check_memory, free_bytes,
                                            memory_limit, parameter_count, token_budget)


@pytest.fixture
def model_dir(tmp_path):
    """A model of 3 M parameters over two safetensors files (12 MiB in float32 per rank)."""
    save_file({"a": torch.zeros(1024, 1024), "b": torch.zeros(1024)}, tmp_path / "model-1.safetensors")
    save_file({"c": torch.zeros(2, 1024, 1023, dtype=torch.bfloat16)}, tmp_path / "model-2.safetensors")
    return tmp_path


def test_parameters_are_counted_from_the_headers(model_dir, tmp_path_factory):
    assert parameter_count(model_dir) == 1024 * 1024 + 1024 + 2 * 1024 * 1023
    assert parameter_count(tmp_path_factory.mktemp("bin-only")) is None


def test_a_limit_below_what_the_ranks_load_is_refused_with_the_field_and_a_size(model_dir):
    params = parameter_count(model_dir)
    with pytest.raises(NotEnoughMemory) as refused:
        check_memory("trainer", 2, model_dir, limit=2 * params * 4 - 1)
    message = str(refused.value)
    assert message.startswith("spec.roles.trainer.resources.memory:") and "set it to at least 1Gi" in message
    check_memory("trainer", 2, model_dir, limit=2 * params * 4)
    check_memory("trainer", 8, model_dir, limit=None)  # no limit: nothing to check


@pytest.mark.parametrize("text, limit", [("max\n", None), ("4294967296\n", 4 * GIB),
                                         ("9223372036854771712\n", None)], ids=["v2-none", "v2-4Gi", "v1-none"])
def test_the_container_limit_is_read_from_cgroup_v2_or_v1(text, limit, tmp_path):
    path = tmp_path / "limit"
    path.write_text(text)
    assert memory_limit((str(tmp_path / "absent"), str(path))) == limit
    assert memory_limit((str(tmp_path / "absent"),)) is None


def test_the_trainer_refuses_before_it_joins_its_world_or_loads_the_model(model_dir, monkeypatch, tmp_path):
    from rlfleet.workers.plan import WorkerContext, cluster_endpoints
    from rlfleet.workers.trainer import worker

    from conftest import make_job

    monkeypatch.setattr(worker, "memory_limit", lambda: GIB // 1024)
    monkeypatch.setattr(worker, "init_world", lambda *args: pytest.fail("joined its world first"))
    job = make_job()
    ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=cluster_endpoints(job), grpc_port=0,
                        metrics_port=0, run_dir=str(tmp_path))
    with pytest.raises(NotEnoughMemory):
        worker.Trainer(ctx, model_dir)


SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)


def test_the_token_budget_grows_with_free_memory_and_checkpointing():
    budget = [token_budget(SMOLLM2, 2, False, free * GIB, 0) for free in (4, 8)]
    assert MIN_TOKENS < budget[0] < budget[1] <= 2 * budget[0] + 1
    # Checkpointing keeps one hidden vector per layer and token: many times more tokens fit.
    assert token_budget(SMOLLM2, 2, True, 4 * GIB, 0) > 5 * budget[0]
    # float32 activations take twice bfloat16's room; gradients and optimizer state come off the top.
    assert token_budget(SMOLLM2, 4, False, 4 * GIB, 0) == pytest.approx(budget[0] / 2, abs=1)
    assert token_budget(SMOLLM2, 2, False, 4 * GIB, GIB) < budget[0]


def test_the_token_budget_stays_within_the_fields_bounds():
    assert token_budget(SMOLLM2, 2, False, 0, GIB) == MIN_TOKENS
    assert token_budget(SMOLLM2, 2, True, 1 << 60, 0) == MAX_TOKENS


def test_free_memory_of_a_cpu_is_what_the_kernel_says_is_available():
    available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    assert 0 < free_bytes(torch.device("cpu")) <= available * 1.5
