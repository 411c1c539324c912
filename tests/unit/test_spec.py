"""The RLJob schema: defaults, the shipped examples, the corpus of refused jobs (tests/bad_jobs.py) with their field
paths, round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bad_jobs import BAD_JOBS, BAD_TEXTS, BILLION_LAUGHS, UNKNOWN_FIELDS, files, job, kubernetes_objects
from rlfleet.workers.spec import (
    API_VERSION,
    KIND,
    MAX_JOB_BYTES,
    RLJob,
    SpecError,
    load_job,
    load_job_text,
    parse_job,
)

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "examples").glob("*.yaml"))


def refused(document) -> list[str]:
    with pytest.raises(SpecError) as error:
        parse_job(document)
    return error.value.problems


def assert_names(problems: list[str], path: str) -> None:
    assert any(p.startswith(f"{path}:") for p in problems), f"no problem at {path!r}: {problems}"


# ---------------------------------------------------------------- good jobs


def test_defaults_parse():
    parsed = parse_job({"metadata": {"name": "t"}})
    assert (parsed.api_version, parsed.kind, parsed.metadata.name, parsed.metadata.namespace) == (
        API_VERSION, KIND, "t", "default")
    spec = parsed.spec
    assert spec.model.type == "tiny" and spec.data.type == "arithmetic"
    assert [s.type for s in spec.scorers] == ["math_answer"]
    assert spec.algorithm.max_staleness == 1 and spec.algorithm.loss.type == "aipo"
    assert spec.generation.segment_tokens is None
    assert spec.roles.generator.engine == "vllm"
    assert [getattr(spec.roles, r).replicas for r in ("generator", "trainer", "scorer")] == [1, 1, 1]
    assert spec.suspend is False


def test_every_example_loads():
    assert EXAMPLES, "manifests/examples/ has no *.yaml"
    for path in EXAMPLES:
        loaded = load_job(str(path))
        assert loaded.metadata.name == yaml.safe_load(path.read_text())["metadata"]["name"], path


def test_job_exactly_at_the_size_cap_loads(tmp_path):
    text = yaml.safe_dump(job())
    padded = text + "#" * (MAX_JOB_BYTES - len(text.encode()) - 1) + "\n"
    assert len(padded.encode()) == MAX_JOB_BYTES
    path = tmp_path / "job.yaml"
    path.write_text(padded)
    assert load_job(str(path)).metadata.name == "t"


# ---------------------------------------------------------------- refused documents


@pytest.mark.parametrize("document, path", [c[1:] for c in BAD_JOBS], ids=[c[0] for c in BAD_JOBS])
def test_bad_job_is_refused_naming_the_field(document, path):
    problems = refused(document)
    assert_names(problems, path)
    # The offending value is quoted in short: a 500 kB string must not come back in the message.
    assert all(len(p) < 600 for p in problems), problems


def test_corpus_is_large_and_ids_unique():
    ids = [c[0] for c in files()]
    assert len(ids) >= 50 and len(ids) == len(set(ids))
    # The operator must refuse at least 50 of them too, under their ids as job names: those must be valid names.
    assert len(kubernetes_objects()) >= 50
    for _, name, _, path in kubernetes_objects():
        if not path.startswith("metadata."):
            parse_job({"metadata": {"name": name}})


DOCUMENT_FILES = [c for c in files() if c[0] not in {t[0] for t in BAD_TEXTS}]


@pytest.mark.parametrize("text, path", [c[1:] for c in DOCUMENT_FILES], ids=[c[0] for c in DOCUMENT_FILES])
def test_bad_document_written_as_yaml_is_refused_the_same(text, path):
    """`rlfleet run` reads the corpus's documents as these files: writing them as YAML must not change what is wrong."""
    with pytest.raises(SpecError) as error:
        load_job_text(text)
    assert_names(error.value.problems, path)


@pytest.mark.parametrize("document, path, allowed", [c[1:] for c in UNKNOWN_FIELDS],
                         ids=[c[0] for c in UNKNOWN_FIELDS])
def test_unknown_field_lists_the_allowed_fields(document, path, allowed):
    problems = refused(document)
    assert f"{path}: unknown field; allowed here: {', '.join(allowed)}" in problems, problems


def test_every_bad_field_is_reported_at_once():
    problems = refused(job(algorithm={"maxStaleness": -1, "steps": 0}, generation={"topP": 2}))
    for path in ("spec.algorithm.maxStaleness", "spec.algorithm.steps", "spec.generation.topP"):
        assert_names(problems, path)


@pytest.mark.parametrize("document", [[], "job", 42, None, [job()]], ids=["list", "str", "int", "none", "list-of-job"])
def test_non_mapping_document_is_refused(document):
    assert_names(refused(document), "<root>")


# ---------------------------------------------------------------- refused files


@pytest.mark.parametrize("content, path", [c[1:] for c in BAD_TEXTS], ids=[c[0] for c in BAD_TEXTS])
def test_bad_file_is_refused(tmp_path, content, path):
    job_file = tmp_path / "job.yaml"
    if isinstance(content, bytes):
        job_file.write_bytes(content)
    else:
        job_file.write_text(content)
    with pytest.raises(SpecError) as error:
        load_job(str(job_file))
    assert_names(error.value.problems, path)
    assert all(len(p) < 600 for p in error.value.problems), error.value.problems


def test_aliases_are_named_as_the_reason():
    with pytest.raises(SpecError) as error:
        load_job_text(BILLION_LAUGHS)
    assert "alias" in error.value.problems[0]


@pytest.mark.parametrize("via", ["file", "text"])
def test_over_one_mebibyte_is_refused(tmp_path, via):
    text = yaml.safe_dump(job())
    text += "#" * (MAX_JOB_BYTES - len(text.encode())) + "\n"
    assert len(text.encode()) == MAX_JOB_BYTES + 1
    with pytest.raises(SpecError) as error:
        if via == "file":
            path = tmp_path / "job.yaml"
            path.write_text(text)
            load_job(str(path))
        else:
            load_job_text(text)
    assert error.value.problems == [f"<file>: larger than {MAX_JOB_BYTES} bytes"]


# ---------------------------------------------------------------- round trips

RICH = job(
    model={"type": "hf", "path": "/models/x", "dtype": "bfloat16"},
    data={"type": "jsonl", "path": "/data/x.jsonl", "promptField": "q", "template": "chat", "heldOut": 5},
    algorithm={"maxStaleness": 0, "groupSize": 4, "loss": {"type": "aipo", "rho": 7.5}, "learningRate": 3e-4},
    generation={"maxNewTokens": 64, "segmentTokens": 16, "topP": 0.9},
    scorers=[{"type": "exact_match", "weight": -0.5}, {"type": "regex_format", "pattern": r"\d+", "timeoutSeconds": 2}],
    roles={"generator": {"replicas": 2, "engine": "torch", "kvCacheMB": 256,
                         "resources": {"cpu": "500m", "memory": "2Gi", "gpu": 1},
                         "nodeSelector": {"zone": "a"},
                         "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
           "trainer": {"replicas": 2}},
    weightSync={"backend": "nccl", "bucketMB": 8},
    checkpoint={"everySteps": 3, "keep": 1},
    failurePolicy={"maxRestarts": 0},
    suspend=True,
)


@pytest.mark.parametrize("document", [{"metadata": {"name": "t"}}, RICH], ids=["defaults", "rich"])
def test_to_dict_round_trips(document):
    first = parse_job(document)
    as_dict = first.to_dict()
    again = parse_job(as_dict)
    assert again == first
    assert again.to_dict() == as_dict
    assert load_job_text(yaml.safe_dump(as_dict)) == first


def test_example_round_trips():
    for path in EXAMPLES:
        loaded = load_job(str(path))
        assert parse_job(loaded.to_dict()) == loaded, path


def test_to_dict_is_camel_case_and_drops_status():
    as_dict = parse_job({**RICH, "status": {"phase": "Running"}}).to_dict()
    assert "status" not in as_dict
    assert as_dict["spec"]["algorithm"]["maxStaleness"] == 0
    assert as_dict["spec"]["roles"]["generator"]["kvCacheMB"] == 256
    assert as_dict["spec"]["weightSync"]["bucketMB"] == 8
    assert isinstance(parse_job(as_dict), RLJob)


def test_deep_nesting_is_refused_not_a_crash():
    with pytest.raises(SpecError) as refused_:
        load_job_text("metadata: " + "[" * 2000 + "]" * 2000)
    assert "nested too deeply" in str(refused_.value) or "YAML" in str(refused_.value)


def test_non_utf8_file_is_refused(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"metadata: {name: \xff\xfe}\n")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_job(str(path))


def test_repeated_keys_are_refused():
    with pytest.raises(SpecError, match="appears twice"):
        load_job_text("metadata: {name: a}\nmetadata: {name: b}\n")


def test_exponent_floats_read_as_numbers():
    parsed = load_job_text("metadata: {name: a}\nspec: {algorithm: {learningRate: 1e-6}}\n")
    assert parsed.spec.algorithm.learning_rate == 1e-6


def test_types_are_not_coerced():
    assert_names(refused(job(algorithm={"steps": "3"})), "spec.algorithm.steps")
    assert_names(refused(job(suspend="yes")), "spec.suspend")


def test_seed_too_large_for_torch_is_refused():
    assert_names(refused(job(algorithm={"seed": 10**30})), "spec.algorithm.seed")


def test_a_key_named_like_a_variant_stays_in_the_path():
    problems = refused(job(roles={"generator": {"nodeSelector": {"tiny": 1}}}))
    assert_names(problems, "spec.roles.generator.nodeSelector.tiny")
