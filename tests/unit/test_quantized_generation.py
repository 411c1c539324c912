"""roles.generator.quantization and kvCacheDtype: what vLLM is asked for, and a job whose loss would leave the
quantized generators' log-prob gap uncorrected is told so in its status (and its controller's log)."""

from __future__ import annotations

import json

import pytest

from rlfleet.operator.assess import CORRECTED, initial_status
from rlfleet.workers.engines.vllm_engine import quantization_options
from rlfleet.workers.spec import uncorrected_quantization

from conftest import make_job

NOW = "2026-12-01T00:00:00Z"


def test_int8_is_torchaos_int8_weight_only_method_with_float32_logits():
    options = quantization_options("int8", "auto")
    assert options["quantization"] == "torchao" and "kv_cache_dtype" not in options
    config = json.loads(options["hf_overrides"]["quantization_config_dict_json"])
    assert config["_type"] == "Int8WeightOnlyConfig"
    assert options["hf_overrides"]["head_dtype"] == "float32"


@pytest.mark.parametrize("method", ["fp8", "fp8_per_channel"])
def test_fp8_methods_are_vllms_own_and_the_kv_cache_its_fp8(method):
    options = quantization_options(method, "fp8")
    assert options["quantization"] == method and options["kv_cache_dtype"] == "fp8"


def test_without_quantization_vllm_gets_only_float32_logits():
    assert quantization_options("none", "auto") == {"hf_overrides": {"head_dtype": "float32"}}


def _job(loss: dict, **generator):
    return make_job(algorithm={"loss": loss}, roles={"generator": generator})


def test_a_quantized_job_without_a_correction_is_told_the_field_and_the_fix():
    problem = uncorrected_quantization(_job({"type": "reinforce", "correction": "none"}, quantization="int8").spec)
    assert "algorithm.loss.correction" in problem and "tis" in problem
    assert uncorrected_quantization(_job({"type": "reinforce", "correction": "none"}, kvCacheDtype="fp8").spec)
    for loss in ({"type": "aipo"}, {"type": "ppo"}, {"type": "reinforce", "correction": "mis"}):
        assert uncorrected_quantization(_job(loss, quantization="int8").spec) is None, loss
    assert uncorrected_quantization(_job({"type": "reinforce", "correction": "none"}).spec) is None


def _corrected(status: dict) -> dict | None:
    return next((c for c in status.get("conditions", []) if c["type"] == CORRECTED), None)


def test_the_status_says_whether_a_quantized_jobs_loss_corrects_its_generators():
    uncorrected = initial_status(_job({"type": "reinforce", "correction": "none"}, quantization="int8"), {}, NOW, 1)
    condition = _corrected(uncorrected)
    assert condition["status"] == "False" and condition["reason"] == "QuantizedWithoutCorrection"
    assert "algorithm.loss.correction" in condition["message"]
    running = {"phase": "Running", "conditions": uncorrected["conditions"]}
    fixed = initial_status(_job({"type": "aipo"}, quantization="int8"), running, NOW, 2)
    assert _corrected(fixed)["status"] == "True"
    # A job that stops quantizing loses the condition; one that never did has none.
    assert _corrected(initial_status(_job({"type": "aipo"}), running, NOW, 3)) is None
    assert _corrected(initial_status(_job({"type": "aipo"}), {}, NOW, 1)) is None
