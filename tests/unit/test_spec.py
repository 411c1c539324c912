"""The RLJob schema: defaults, the shipped examples, a corpus of refused jobs with their field paths, round trips."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

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


def job(**spec) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "t"}, "spec": spec}


def named(name, **metadata) -> dict:
    return {"metadata": {"name": name, **metadata}}


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

BAD_JOBS = [
    # wrong types
    ("hidden-size-string", job(model={"type": "tiny", "hiddenSize": "big"}), "spec.model.hiddenSize"),
    ("steps-fraction", job(algorithm={"steps": 1.5}), "spec.algorithm.steps"),
    ("learning-rate-string", job(algorithm={"learningRate": "fast"}), "spec.algorithm.learningRate"),
    ("temperature-list", job(generation={"temperature": [1.0]}), "spec.generation.temperature"),
    ("scorers-mapping", job(scorers={"type": "math_answer"}), "spec.scorers"),
    ("model-string", job(model="tiny"), "spec.model"),
    ("spec-list", {**job(), "spec": []}, "spec"),
    ("suspend-maybe", job(suspend="maybe"), "spec.suspend"),
    ("operations-string", job(data={"type": "arithmetic", "operations": "+"}), "spec.data.operations"),
    ("node-selector-int", job(roles={"generator": {"nodeSelector": {"zone": 1}}}),
     "spec.roles.generator.nodeSelector.zone"),
    ("operation-unknown", job(data={"type": "arithmetic", "operations": ["+", "/"]}), "spec.data.operations.1"),
    ("engine-unknown", job(roles={"generator": {"engine": "sglang"}}), "spec.roles.generator.engine"),
    ("backend-unknown", job(weightSync={"backend": "mpi"}), "spec.weightSync.backend"),
    ("dtype-unknown", job(model={"type": "tiny", "dtype": "float16"}), "spec.model.dtype"),
    ("toleration-operator", job(roles={"trainer": {"tolerations": [{"operator": "Maybe"}]}}),
     "spec.roles.trainer.tolerations.0.operator"),
    # negative and absurd values
    ("max-staleness-negative", job(algorithm={"maxStaleness": -1}), "spec.algorithm.maxStaleness"),
    ("max-staleness-huge", job(algorithm={"maxStaleness": 65}), "spec.algorithm.maxStaleness"),
    ("generator-replicas-0", job(roles={"generator": {"replicas": 0}}), "spec.roles.generator.replicas"),
    ("scorer-replicas-0", job(roles={"scorer": {"replicas": 0}}), "spec.roles.scorer.replicas"),
    ("trainer-replicas-huge", job(roles={"trainer": {"replicas": 10**6}}), "spec.roles.trainer.replicas"),
    ("group-size-1", job(algorithm={"groupSize": 1}), "spec.algorithm.groupSize"),
    ("steps-0", job(algorithm={"steps": 0}), "spec.algorithm.steps"),
    ("learning-rate-0", job(algorithm={"learningRate": 0}), "spec.algorithm.learningRate"),
    ("learning-rate-nan", job(algorithm={"learningRate": math.nan}), "spec.algorithm.learningRate"),
    ("grad-clip-inf", job(algorithm={"gradClip": math.inf}), "spec.algorithm.gradClip"),
    ("rho-below-2", job(algorithm={"loss": {"type": "aipo", "rho": 1.9}}), "spec.algorithm.loss.rho"),
    ("rho-above-10", job(algorithm={"loss": {"type": "aipo", "rho": 10.5}}), "spec.algorithm.loss.rho"),
    ("temperature-0", job(generation={"temperature": 0}), "spec.generation.temperature"),
    ("top-p-above-1", job(generation={"topP": 1.5}), "spec.generation.topP"),
    ("max-new-tokens-0", job(generation={"maxNewTokens": 0}), "spec.generation.maxNewTokens"),
    ("segment-over-max-new", job(generation={"maxNewTokens": 4, "segmentTokens": 8}), "spec.generation"),
    ("gpu-negative", job(roles={"generator": {"resources": {"gpu": -1}}}), "spec.roles.generator.resources.gpu"),
    ("kv-cache-tiny", job(roles={"generator": {"kvCacheMB": 1}}), "spec.roles.generator.kvCacheMB"),
    ("bucket-0", job(weightSync={"bucketMB": 0}), "spec.weightSync.bucketMB"),
    ("sync-timeout-0", job(weightSync={"timeoutSeconds": 0}), "spec.weightSync.timeoutSeconds"),
    ("keep-0", job(checkpoint={"keep": 0}), "spec.checkpoint.keep"),
    ("max-restarts-negative", job(failurePolicy={"maxRestarts": -1}), "spec.failurePolicy.maxRestarts"),
    ("held-out-negative", job(data={"type": "arithmetic", "heldOut": -1}), "spec.data.heldOut"),
    ("scorer-weight-huge", job(scorers=[{"type": "math_answer", "weight": 1e9}]), "spec.scorers.0.weight"),
    ("scorer-timeout-negative", job(scorers=[{"type": "exact_match", "timeoutSeconds": -1}]),
     "spec.scorers.0.timeoutSeconds"),
    ("toleration-seconds-negative", job(roles={"scorer": {"tolerations": [{"tolerationSeconds": -5}]}}),
     "spec.roles.scorer.tolerations.0.tolerationSeconds"),
    ("trainers-exceed-samples",
     job(algorithm={"groupSize": 2, "promptsPerStep": 1}, roles={"trainer": {"replicas": 3}}), "spec"),
    # tiny model shape
    ("head-dim-16", job(model={"type": "tiny", "hiddenSize": 64, "numHeads": 4}), "spec.model"),
    ("head-dim-not-whole", job(model={"type": "tiny", "hiddenSize": 100, "numHeads": 3}), "spec.model"),
    ("hidden-size-16", job(model={"type": "tiny", "hiddenSize": 16, "numHeads": 1}), "spec.model.hiddenSize"),
    ("num-layers-0", job(model={"type": "tiny", "numLayers": 0}), "spec.model.numLayers"),
    # regular expressions
    ("regex-unbalanced", job(scorers=[{"type": "regex_format", "pattern": "("}]), "spec.scorers.0.pattern"),
    ("regex-bad-class-second-item",
     job(scorers=[{"type": "math_answer"}, {"type": "regex_format", "pattern": "[a-"}]), "spec.scorers.1.pattern"),
    ("regex-missing", job(scorers=[{"type": "regex_format"}]), "spec.scorers.0.pattern"),
    # unions: unknown tags, missing variant fields
    ("model-type-unknown", job(model={"type": "gpt"}), "spec.model"),
    ("scorer-type-unknown", job(scorers=[{"type": "llm_judge"}]), "spec.scorers.0"),
    ("loss-type-unknown", job(algorithm={"loss": {"type": "ppo"}}), "spec.algorithm.loss.type"),
    ("hf-path-missing", job(model={"type": "hf"}), "spec.model.path"),
    ("jsonl-path-missing", job(data={"type": "jsonl"}), "spec.data.path"),
    ("scorers-empty", job(scorers=[]), "spec.scorers"),
    ("scorers-too-many", job(scorers=[{"type": "math_answer"}] * 33), "spec.scorers"),
    # metadata, apiVersion, kind
    ("metadata-missing", {"spec": {}}, "metadata"),
    ("name-missing", {"metadata": {"namespace": "ml"}}, "metadata.name"),
    ("name-uppercase", named("Bad_Name"), "metadata.name"),
    ("name-leading-dash", named("-job"), "metadata.name"),
    ("name-trailing-dash", named("job-"), "metadata.name"),
    ("name-leading-digit", named("9job"), "metadata.name"),
    ("name-dot", named("a.b"), "metadata.name"),
    ("name-empty", named(""), "metadata.name"),
    ("name-newline", named("job\n"), "metadata.name"),
    ("name-43-chars", named("a" * 43), "metadata.name"),
    ("name-int", named(7), "metadata.name"),
    ("namespace-bad", named("t", namespace="Prod"), "metadata.namespace"),
    ("api-version-wrong", {**job(), "apiVersion": "v1"}, "apiVersion"),
    ("kind-wrong", {**job(), "kind": "Pod"}, "kind"),
    # huge strings
    ("data-path-huge", job(data={"type": "jsonl", "path": "x" * 5000}), "spec.data.path"),
    ("prompt-field-huge", job(data={"type": "jsonl", "path": "p", "promptField": "x" * 300}), "spec.data.promptField"),
    ("hf-path-empty", job(model={"type": "hf", "path": ""}), "spec.model.path"),
    ("regex-huge", job(scorers=[{"type": "regex_format", "pattern": "a" * 500_000}]), "spec.scorers.0.pattern"),
    ("toleration-key-huge", job(roles={"trainer": {"tolerations": [{"key": "k" * 254}]}}),
     "spec.roles.trainer.tolerations.0.key"),
    # Kubernetes quantities
    ("cpu-word", job(roles={"trainer": {"resources": {"cpu": "lots"}}}), "spec.roles.trainer.resources.cpu"),
    ("memory-space", job(roles={"trainer": {"resources": {"memory": "4 Gi"}}}), "spec.roles.trainer.resources.memory"),
    ("memory-negative", job(roles={"scorer": {"resources": {"memory": "-1Gi"}}}), "spec.roles.scorer.resources.memory"),
    ("memory-suffix", job(roles={"generator": {"resources": {"memory": "4GiB"}}}),
     "spec.roles.generator.resources.memory"),
    ("cpu-two-dots", job(roles={"generator": {"resources": {"cpu": "1.5.5"}}}), "spec.roles.generator.resources.cpu"),
    ("cpu-empty", job(roles={"generator": {"resources": {"cpu": ""}}}), "spec.roles.generator.resources.cpu"),
]


@pytest.mark.parametrize("document, path", [c[1:] for c in BAD_JOBS], ids=[c[0] for c in BAD_JOBS])
def test_bad_job_is_refused_naming_the_field(document, path):
    problems = refused(document)
    assert_names(problems, path)
    # The offending value is quoted in short: a 500 kB string must not come back in the message.
    assert all(len(p) < 600 for p in problems), problems


def test_corpus_is_large_and_ids_unique():
    ids = [c[0] for c in BAD_JOBS] + [c[0] for c in UNKNOWN_FIELDS] + [c[0] for c in BAD_TEXTS]
    assert len(ids) >= 40 and len(ids) == len(set(ids))


UNKNOWN_FIELDS = [
    ("unknown-at-root", {**job(), "extra": 1}, "extra", ["apiVersion", "kind", "metadata", "spec", "status"]),
    ("unknown-in-spec", job(extra=1), "spec.extra",
     ["algorithm", "checkpoint", "data", "failurePolicy", "generation", "model", "roles", "scorers", "suspend",
      "weightSync"]),
    ("unknown-in-tiny-variant", job(model={"type": "tiny", "heads": 4}), "spec.model.heads",
     ["dtype", "hiddenSize", "intermediateSize", "numHeads", "numLayers", "seed", "type"]),
    ("tiny-field-in-smollm2-variant", job(model={"type": "smollm2", "hiddenSize": 64}), "spec.model.hiddenSize",
     ["dtype", "type"]),
    ("unknown-in-jsonl-variant", job(data={"type": "jsonl", "path": "p", "seed": 1}), "spec.data.seed",
     ["answerField", "heldOut", "path", "promptField", "template", "type"]),
    ("unknown-in-list-item-variant",
     job(scorers=[{"type": "math_answer"}, {"type": "regex_format", "pattern": "x", "flags": "i"}]),
     "spec.scorers.1.flags", ["pattern", "timeoutSeconds", "type", "weight"]),
    ("unknown-in-loss", job(algorithm={"loss": {"type": "aipo", "clip": 0.2}}), "spec.algorithm.loss.clip",
     ["rho", "type"]),
    ("snake-case-typo-in-algorithm", job(algorithm={"max_stale": 1}), "spec.algorithm.max_stale",
     ["gradClip", "groupSize", "learningRate", "loss", "maxStaleness", "promptsPerStep", "seed", "steps",
      "weightDecay"]),
    ("unknown-in-toleration-item", job(roles={"generator": {"tolerations": [{"key": "a"}, {"key": "b", "x": 1}]}}),
     "spec.roles.generator.tolerations.1.x", ["effect", "key", "operator", "tolerationSeconds", "value"]),
    ("unknown-in-resources", job(roles={"trainer": {"resources": {"gpus": 1}}}), "spec.roles.trainer.resources.gpus",
     ["cpu", "gpu", "memory"]),
    ("engine-on-scorer-role", job(roles={"scorer": {"engine": "torch"}}), "spec.roles.scorer.engine",
     ["affinity", "nodeSelector", "replicas", "resources", "tolerations"]),
    ("unknown-in-weight-sync", job(weightSync={"bucketMb": 4}), "spec.weightSync.bucketMb",
     ["backend", "bucketMB", "timeoutSeconds"]),
]


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

BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [" + ", ".join([f"*{chr(ord('a') + i - 1)}"] * 9) + "]"
       for i in range(1, 9)]
) + "\n"

BAD_TEXTS = [
    ("invalid-yaml-flow", "metadata: [", "<file>"),
    ("invalid-yaml-tab", "metadata:\n\tname: t\n", "<file>"),
    ("billion-laughs", BILLION_LAUGHS, "<file>"),
    ("alias-to-metadata", "m: &m {name: t}\nmetadata: *m\n", "<file>"),
    ("merge-key-alias", "base: &b {name: t}\nmetadata: {<<: *b}\n", "<file>"),
    ("python-object-tag", "metadata: !!python/object/apply:os.system ['true']\n", "<file>"),
    ("yaml-list", "- metadata: {name: t}\n", "<root>"),
    ("yaml-scalar", "just a string\n", "<root>"),
    ("yaml-empty", "", "<root>"),
    ("yaml-bad-field", "metadata: {name: t}\nspec:\n  algorithm: {maxStaleness: -1}\n", "spec.algorithm.maxStaleness"),
]


@pytest.mark.parametrize("text, path", [c[1:] for c in BAD_TEXTS], ids=[c[0] for c in BAD_TEXTS])
def test_bad_text_is_refused(text, path):
    with pytest.raises(SpecError) as error:
        load_job_text(text)
    assert_names(error.value.problems, path)


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
