"""`model.dtype: auto`: bfloat16 where the trainers and generators multiply fast in it, float32 elsewhere, decided
once for a job (the weight push's wire dtype must be the same on both sides)."""

from __future__ import annotations

import json

import pytest

from rlfleet.operator.objects import JOB_FILE, build_configmap
from rlfleet.workers.models.precision import cpu_has_fast_bfloat16, resolve_dtype, weights_dtype
from rlfleet.workers.sync.shards import SyncSettings

from conftest import make_job

SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC_ZEN3 = "flags\t\t: fpu sse4_2 avx avx2 fma\n"


def cpu(tmp_path, text: str):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: test\n" + text)
    return path


def dtype(job, fast: bool) -> str:
    return resolve_dtype(job, fast).spec.model.dtype


def test_the_cpu_flags_decide_whether_bfloat16_is_fast(tmp_path):
    assert cpu_has_fast_bfloat16(cpu(tmp_path, SAPPHIRE_RAPIDS))
    assert not cpu_has_fast_bfloat16(cpu(tmp_path, EPYC_ZEN3))
    assert not cpu_has_fast_bfloat16(tmp_path / "missing")


def test_auto_is_bfloat16_on_gpus_and_on_fast_cpus_and_float32_on_other_cpus():
    on_cpus = make_job(model={"type": "tiny", "dtype": "auto"})
    on_gpus = make_job(model={"type": "tiny", "dtype": "auto"},
                       roles={"trainer": {"resources": {"gpu": 1}}, "generator": {"resources": {"gpu": 1}}})
    assert (dtype(on_cpus, True), dtype(on_cpus, False)) == ("bfloat16", "float32")
    assert (dtype(on_gpus, True), dtype(on_gpus, False)) == ("bfloat16", "bfloat16")


def test_a_cpu_trainer_beside_gpu_generators_keeps_float32_unless_its_cpu_is_fast():
    job = make_job(model={"type": "tiny", "dtype": "auto"}, roles={"generator": {"resources": {"gpu": 1}}})
    assert (dtype(job, True), dtype(job, False)) == ("bfloat16", "float32")


@pytest.mark.parametrize("chosen", ["float32", "bfloat16"])
def test_a_dtype_the_job_names_is_kept(chosen):
    job = make_job(model={"type": "tiny", "dtype": chosen})
    assert dtype(job, True) == dtype(job, False) == chosen


def test_the_operator_decides_auto_by_gpus_alone_for_every_pod(monkeypatch):
    """Pods of CPU roles may land on nodes with and without AMX: resolved once in the job file they all read."""
    monkeypatch.setattr("rlfleet.workers.models.precision.cpu_has_fast_bfloat16", lambda: True)
    job = make_job(model={"type": "tiny", "dtype": "auto"})
    document = json.loads(build_configmap(job)["data"][JOB_FILE])
    assert document["spec"]["model"]["dtype"] == "float32"
    assert weights_dtype(job) == "bfloat16"  # a local run on this (pretended AMX) machine


def test_the_weight_push_travels_in_the_resolved_dtype(monkeypatch):
    job = make_job(model={"type": "tiny", "dtype": "auto"})
    for fast, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr("rlfleet.workers.models.precision.cpu_has_fast_bfloat16", lambda fast=fast: fast)
        assert SyncSettings.from_job(job).dtype == expected
