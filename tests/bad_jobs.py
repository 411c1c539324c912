"""Malformed RLJobs: one corpus, refused by every layer that reads a job.

The spec refuses each (tests/unit/test_spec.py), so does `rlfleet run` (tests/integration/test_bad_jobs_cli.py)
and so does the operator (tests/unit/test_operator_refuses.py, tests/integration/test_operator_kopf.py), each
naming the entry's field path and creating nothing. Add new bad jobs here, not in those tests.

BAD_JOBS and UNKNOWN_FIELDS are decoded documents (`(id, document, path)`; unknown fields add the allowed
names); BAD_TEXTS are files as written (`(id, text or bytes, path)`): YAML bombs, broken YAML, oversized files.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from rlfleet.workers.spec import API_VERSION, KIND, MAX_JOB_BYTES


def job(**spec) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "t"}, "spec": spec}


def named(name, **metadata) -> dict:
    return {"metadata": {"name": name, **metadata}}


BAD_JOBS = [
    # wrong types
    ("hidden-size-string", job(model={"type": "tiny", "hiddenSize": "big"}), "spec.model.hiddenSize"),
    ("steps-fraction", job(algorithm={"steps": 1.5}), "spec.algorithm.steps"),
    ("learning-rate-string", job(algorithm={"learningRate": "fast"}), "spec.algorithm.learningRate"),
    ("temperature-list", job(generation={"temperature": [1.0]}), "spec.generation.temperature"),
    ("scorers-mapping", job(scorers={"type": "math_answer"}), "spec.scorers"),
    ("model-string", job(model="tiny"), "spec.model"),
    ("spec-list", {**job(), "spec": []}, "spec"),
    ("spec-string", {**job(), "spec": "fast"}, "spec"),
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
    ("trainer-replicas-0", job(roles={"trainer": {"replicas": 0}}), "spec.roles.trainer.replicas"),
    ("max-new-tokens-huge", job(generation={"maxNewTokens": 10**9}), "spec.generation.maxNewTokens"),
    ("prompts-per-step-huge", job(algorithm={"promptsPerStep": 10**12}), "spec.algorithm.promptsPerStep"),
    ("sync-timeout-a-week", job(weightSync={"timeoutSeconds": 604800}), "spec.weightSync.timeoutSeconds"),
    ("group-size-1", job(algorithm={"groupSize": 1}), "spec.algorithm.groupSize"),
    ("steps-0", job(algorithm={"steps": 0}), "spec.algorithm.steps"),
    ("learning-rate-0", job(algorithm={"learningRate": 0}), "spec.algorithm.learningRate"),
    ("learning-rate-nan", job(algorithm={"learningRate": math.nan}), "spec.algorithm.learningRate"),
    ("grad-clip-inf", job(algorithm={"gradClip": math.inf}), "spec.algorithm.gradClip"),
    ("rho-below-2", job(algorithm={"loss": {"type": "aipo", "rho": 1.9}}), "spec.algorithm.loss.rho"),
    ("rho-above-10", job(algorithm={"loss": {"type": "aipo", "rho": 10.5}}), "spec.algorithm.loss.rho"),
    ("temperature-0", job(generation={"temperature": 0}), "spec.generation.temperature"),
    # vLLM would sample at 0.01 and the trainer would score at 0.005
    ("temperature-below-vllm-floor", job(generation={"temperature": 0.005}), "spec.generation.temperature"),
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
    ("evaluation-without-held-out", job(data={"type": "arithmetic", "heldOut": 0}, evaluation={"everySteps": 5}), "spec"),
    # tiny model shape
    # missing model: the field may be left out (a tiny model), but not left empty
    ("model-null", job(model=None), "spec.model"),
    ("model-empty", job(model={}), "spec.model"),
    ("model-type-missing", job(model={"hiddenSize": 128}), "spec.model"),
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
    ("loss-type-unknown", job(algorithm={"loss": {"type": "dpo"}}), "spec.algorithm.loss"),
    ("ppo-clip-not-positive", job(algorithm={"loss": {"type": "ppo", "epsLow": 0}}), "spec.algorithm.loss.epsLow"),
    ("advantage-unknown", job(algorithm={"advantage": "vtrace"}), "spec.algorithm.advantage"),
    ("hf-path-missing", job(model={"type": "hf"}), "spec.model"),
    ("hf-path-and-uri", job(model={"type": "hf", "path": "/m", "uri": "hf://o/n"}), "spec.model"),
    ("hf-uri-with-a-file", job(model={"type": "hf", "uri": "hf://o/n/config.json"}), "spec.model.uri"),
    ("model-uri-scheme", job(model={"type": "hf", "uri": "https://example.com/m"}), "spec.model.uri"),
    ("jsonl-path-missing", job(data={"type": "jsonl"}), "spec.data"),
    ("jsonl-uri-no-file", job(data={"type": "jsonl", "uri": "s3://bucket"}), "spec.data.uri"),
    ("gym-datasets-missing", job(data={"type": "reasoning_gym"}), "spec.data.datasets"),
    ("gym-datasets-empty", job(data={"type": "reasoning_gym", "datasets": {}}), "spec.data.datasets"),
    ("gym-weight-zero", job(data={"type": "reasoning_gym", "datasets": {"chain_sum": 0}}),
     "spec.data.datasets.chain_sum.weight"),
    ("gym-weight-negative", job(data={"type": "reasoning_gym", "datasets": {"chain_sum": {"weight": -1}}}),
     "spec.data.datasets.chain_sum.weight"),
    ("gym-scorer-without-gym-data", job(scorers=[{"type": "reasoning_gym"}]), "spec"),
    ("gym-answer-tag-not-a-name", job(data={"type": "reasoning_gym", "datasets": {"chain_sum": 1}},
                                      scorers=[{"type": "reasoning_gym", "answerTag": "a>b"}]),
     "spec.scorers.0.answerTag"),
    ("scorers-empty", job(scorers=[]), "spec.scorers"),
    ("python-scorer-nowhere", job(scorers=[{"type": "python"}]), "spec.scorers.0"),
    ("python-scorer-path-and-module", job(scorers=[{"type": "python", "path": "r.py", "module": "r"}]),
     "spec.scorers.0"),
    ("python-scorer-function-dotted", job(scorers=[{"type": "python", "module": "r", "function": "a.b"}]),
     "spec.scorers.0.function"),
    ("python-scorer-source-huge", job(scorers=[{"type": "python", "path": "r.py", "source": "#" * 300_000}]),
     "spec.scorers.0.source"),
    # Each file fits, together they would not fit the ConfigMap once JSON-escaped.
    ("python-scorers-too-large", job(scorers=[{"type": "python", "path": "r.py", "source": "\n" * 100_000}] * 4),
     "spec"),
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
    ("name-huge", named("a" * 100_000), "metadata.name"),
    ("node-selector-key-huge", job(roles={"generator": {"nodeSelector": {"k" * 1000: "v"}}}),
     "spec.roles.generator.nodeSelector"),
    ("node-selector-value-huge", job(roles={"trainer": {"nodeSelector": {"zone": "v" * 64}}}),
     "spec.roles.trainer.nodeSelector"),
    ("node-selector-key-slashes", job(roles={"scorer": {"nodeSelector": {"a/b/c": "v"}}}),
     "spec.roles.scorer.nodeSelector"),
    # Kubernetes quantities
    ("cpu-word", job(roles={"trainer": {"resources": {"cpu": "lots"}}}), "spec.roles.trainer.resources.cpu"),
    ("memory-space", job(roles={"trainer": {"resources": {"memory": "4 Gi"}}}), "spec.roles.trainer.resources.memory"),
    ("memory-negative", job(roles={"scorer": {"resources": {"memory": "-1Gi"}}}), "spec.roles.scorer.resources.memory"),
    ("memory-suffix", job(roles={"generator": {"resources": {"memory": "4GiB"}}}),
     "spec.roles.generator.resources.memory"),
    ("cpu-two-dots", job(roles={"generator": {"resources": {"cpu": "1.5.5"}}}), "spec.roles.generator.resources.cpu"),
    ("cpu-empty", job(roles={"generator": {"resources": {"cpu": ""}}}), "spec.roles.generator.resources.cpu"),
    ("extra-resource-quantity", job(roles={"trainer": {"resources": {"extra": {"rdma/hca": "one"}}}}),
     "spec.roles.trainer.resources.extra"),
    ("extra-resource-gpu", job(roles={"trainer": {"resources": {"extra": {"nvidia.com/gpu": "8"}}}}),
     "spec.roles.trainer.resources.extra"),
    ("ranks-not-gpus", job(roles={"trainer": {"ranksPerPod": 2, "resources": {"gpu": 8}}}), "spec.roles.trainer"),
    ("tp-over-gpus", job(roles={"generator": {"tensorParallelSize": 8, "resources": {"gpu": 4}}}),
     "spec.roles.generator"),
    ("ranks-over-batch", job(roles={"trainer": {"replicas": 2, "ranksPerPod": 40}}), "spec"),
    ("quantized-torch-engine", job(roles={"generator": {"engine": "torch", "quantization": "int8"}}),
     "spec.roles.generator"),
    ("fp8-kv-torch-engine", job(roles={"generator": {"engine": "torch", "kvCacheDtype": "fp8"}}), "spec.roles.generator"),
    ("quantization-unknown", job(roles={"generator": {"quantization": "int4"}}), "spec.roles.generator.quantization"),
    ("fp8-in-float32", job(model={"type": "tiny", "dtype": "float32"}, roles={"generator": {"quantization": "fp8"}}),
     "spec"),
    ("stages-not-dividing-ranks", job(roles={"trainer": {"replicas": 3, "pipelineParallel": 2}}), "spec.roles.trainer"),
    ("stages-zero", job(roles={"trainer": {"pipelineParallel": 0}}), "spec.roles.trainer.pipelineParallel"),
    ("stages-over-layers", job(roles={"trainer": {"replicas": 3, "pipelineParallel": 3}}), "spec"),
    ("stages-with-lora", job(roles={"trainer": {"replicas": 2, "pipelineParallel": 2}}, training={"lora": {}}),
     "spec"),
    # the reference executor and KL
    ("kl-without-reference", job(algorithm={"kl": {"coef": 0.1}}), "spec"),
    ("kl-estimator", job(roles={"reference": {}}, algorithm={"kl": {"estimator": "k4"}}), "spec.algorithm.kl.estimator"),
    ("kl-negative", job(roles={"reference": {}}, algorithm={"kl": {"coef": -1}}), "spec.algorithm.kl.coef"),
    ("kl-use", job(roles={"reference": {}}, algorithm={"kl": {"use": "advantage"}}), "spec.algorithm.kl.use"),
    ("kl-k1-loss", job(roles={"reference": {}}, algorithm={"kl": {"coef": 0.1, "estimator": "k1"}}),
     "spec.algorithm.kl"),
    ("kl-k3-reward", job(roles={"reference": {}}, algorithm={"kl": {"coef": 0.1, "use": "reward"}}),
     "spec.algorithm.kl"),
    ("guidance-with-kl-reward",
     job(roles={"reference": {}}, algorithm={"guidance": "answer", "kl": {"use": "reward"}}), "spec.algorithm"),
    ("guidance-unknown", job(algorithm={"guidance": "hints"}), "spec.algorithm.guidance"),
    ("guidance-answer-in-episodes", job(roles={"environment": {"type": "tools"}}, algorithm={"guidance": "answer"}),
     "spec"),
    # generation.adaptiveTemperature
    ("adaptive-temperature-colder", job(generation={"temperature": 2.0, "adaptiveTemperature": {}}),
     "spec.generation"),
    ("adaptive-temperature-ratio-0", job(generation={"adaptiveTemperature": {"targetRatio": 0}}),
     "spec.generation.adaptiveTemperature.targetRatio"),
    ("adaptive-temperature-follows-unknown", job(generation={"adaptiveTemperature": {"follows": "rewards"}}),
     "spec.generation.adaptiveTemperature.follows"),
    ("adaptive-temperature-all-solved", job(generation={"adaptiveTemperature": {"solvedShare": 1.0}}),
     "spec.generation.adaptiveTemperature.solvedShare"),
    ("adaptive-temperature-uncorrected", job(generation={"adaptiveTemperature": {}},
                                             algorithm={"loss": {"type": "reinforce", "correction": "none"}}), "spec"),
    ("adaptive-temperature-with-kl-reward", job(roles={"reference": {}}, generation={"adaptiveTemperature": {}},
                                                algorithm={"kl": {"coef": 0.1, "estimator": "k1", "use": "reward"}}),
     "spec"),
    ("adaptive-temperature-with-agent", job(generation={"adaptiveTemperature": {}}, roles={"environment": {
        "type": "agent", "path": "manifests/examples/agent/second_look.py"}}), "spec"),
    ("reference-update-negative", job(roles={"reference": {"updateEverySteps": -1}}),
     "spec.roles.reference.updateEverySteps"),
    # the reward-model executor
    ("reward-model-without-path", job(roles={"rewardModel": {}}), "spec.roles.rewardModel.path"),
    ("reward-model-path-empty", job(roles={"rewardModel": {"path": ""}}), "spec.roles.rewardModel.path"),
    ("reward-model-batch-0", job(roles={"rewardModel": {"path": "/m", "batchSize": 0}}),
     "spec.roles.rewardModel.batchSize"),
    ("reward-model-timeout-0", job(roles={"rewardModel": {"path": "/m", "timeoutSeconds": 0}}),
     "spec.roles.rewardModel.timeoutSeconds"),
    ("reward-model-weight-string", job(roles={"rewardModel": {"path": "/m", "weight": "high"}}),
     "spec.roles.rewardModel.weight"),
    ("reward-model-template", job(roles={"rewardModel": {"path": "/m", "template": "llama3"}}),
     "spec.roles.rewardModel.template"),
    ("reward-model-two-gpus", job(roles={"rewardModel": {"path": "/m", "resources": {"gpu": 2}}}),
     "spec.roles.rewardModel.resources"),
    ("reward-model-replicas-0", job(roles={"rewardModel": {"path": "/m", "replicas": 0}}),
     "spec.roles.rewardModel.replicas"),
    # the critic executor, GAE and PPO's epochs
    ("gae-without-critic", job(algorithm={"advantage": "gae"}), "spec"),
    ("critic-without-gae", job(roles={"critic": {}}), "spec"),
    ("critic-two-replicas", job(algorithm={"advantage": "gae"}, roles={"critic": {"replicas": 2}}),
     "spec.roles.critic.replicas"),
    ("critic-ranks-not-gpus", job(algorithm={"advantage": "gae"},
                                  roles={"critic": {"ranksPerPod": 2, "resources": {"gpu": 4}}}), "spec.roles.critic"),
    ("critic-value-clip-negative", job(algorithm={"advantage": "gae"}, roles={"critic": {"valueClip": -1}}),
     "spec.roles.critic.valueClip"),
    ("gae-lambda-over-1", job(algorithm={"advantage": "gae", "gae": {"lambda": 1.5}}, roles={"critic": {}}),
     "spec.algorithm.gae.lambda"),
    ("epochs-0", job(algorithm={"epochs": 0}), "spec.algorithm.epochs"),
    ("mini-batches-0", job(algorithm={"miniBatches": 0}), "spec.algorithm.miniBatches"),
    # NCCL and friends
    ("env-reserved", job(roles={"trainer": {"env": {"WORLD_SIZE": "32"}}}), "spec.roles.trainer.env"),
    ("env-ours", job(roles={"generator": {"env": {"RLFLEET_ROLE": "trainer"}}}), "spec.roles.generator.env"),
    ("env-name", job(roles={"scorer": {"env": {"NCCL DEBUG": "INFO"}}}), "spec.roles.scorer.env"),
    # storage
    ("volume-two-sources", job(storage={"volumes": [{"name": "m", "mountPath": "/m", "claim": "c",
                                                     "hostPath": "/x"}]}), "spec.storage.volumes.0"),
    ("volume-no-source", job(storage={"volumes": [{"name": "m", "mountPath": "/m"}]}), "spec.storage.volumes.0"),
    ("volume-hides-config", job(storage={"volumes": [{"name": "m", "mountPath": "/etc", "claim": "c"}]}),
     "spec.storage.volumes.0"),
    ("volume-relative", job(storage={"volumes": [{"name": "m", "mountPath": "models", "claim": "c"}]}),
     "spec.storage.volumes.0.mountPath"),
    ("volume-names-repeat", job(storage={"volumes": [{"name": "m", "mountPath": "/a", "claim": "c"},
                                                     {"name": "m", "mountPath": "/b", "claim": "c"}]}), "spec.storage"),
    ("volume-role", job(storage={"volumes": [{"name": "m", "mountPath": "/a", "claim": "c", "roles": ["actor"]}]}),
     "spec.storage.volumes.0.roles.0"),
    ("claim-name", job(storage={"checkpointClaim": "Bad_Name"}), "spec.storage.checkpointClaim"),
]


UNKNOWN_FIELDS = [
    ("unknown-at-root", {**job(), "extra": 1}, "extra", ["apiVersion", "kind", "metadata", "spec", "status"]),
    ("unknown-in-spec", job(extra=1), "spec.extra",
     ["algorithm", "checkpoint", "data", "evaluation", "failurePolicy", "generation", "model", "roles", "scorers",
      "storage", "suspend", "tracking", "training", "weightSync"]),
    ("unknown-in-tiny-variant", job(model={"type": "tiny", "heads": 4}), "spec.model.heads",
     ["dtype", "hiddenSize", "intermediateSize", "numHeads", "numLayers", "seed", "tieEmbeddings", "toolCalls", "type"]),
    ("tiny-field-in-smollm2-variant", job(model={"type": "smollm2", "hiddenSize": 64}), "spec.model.hiddenSize",
     ["dtype", "type"]),
    ("unknown-in-jsonl-variant", job(data={"type": "jsonl", "path": "p", "seed": 1}), "spec.data.seed",
     ["answerField", "heldOut", "messagesField", "path", "promptField", "shuffle", "shuffleSeed", "systemPrompt",
      "template", "type", "uri"]),
    ("unknown-in-gym-dataset",
     job(data={"type": "reasoning_gym", "datasets": {"chain_sum": {"weight": 1, "options": {}}}}),
     "spec.data.datasets.chain_sum.options", ["config", "weight"]),
    ("unknown-in-list-item-variant",
     job(scorers=[{"type": "math_answer"}, {"type": "regex_format", "pattern": "x", "flags": "i"}]),
     "spec.scorers.1.flags", ["pattern", "timeoutSeconds", "type", "weight"]),
    ("unknown-in-loss", job(algorithm={"loss": {"type": "aipo", "clip": 0.2}}), "spec.algorithm.loss.clip",
     ["rho", "type"]),
    ("snake-case-typo-in-algorithm", job(algorithm={"max_stale": 1}), "spec.algorithm.max_stale",
     ["advantage", "epochs", "gae", "gradClip", "groupSize", "guidance", "kl", "learningRate", "loss", "maxStaleness",
      "miniBatches", "promptsPerStep", "seed", "steps", "weightDecay"]),
    ("unknown-in-toleration-item", job(roles={"generator": {"tolerations": [{"key": "a"}, {"key": "b", "x": 1}]}}),
     "spec.roles.generator.tolerations.1.x", ["effect", "key", "operator", "tolerationSeconds", "value"]),
    ("unknown-in-resources", job(roles={"trainer": {"resources": {"gpus": 1}}}), "spec.roles.trainer.resources.gpus",
     ["cpu", "extra", "gpu", "memory"]),
    ("reward-role-id-as-section", job(roles={"reward": {"path": "/m"}}), "spec.roles.reward",
     ["controller", "critic", "environment", "generator", "reference", "rewardModel", "scorer", "trainer"]),
    ("engine-on-scorer-role", job(roles={"scorer": {"engine": "torch"}}), "spec.roles.scorer.engine",
     ["affinity", "env", "hostNetwork", "nodeSelector", "replicas", "resources", "tolerations"]),
    ("unknown-in-weight-sync", job(weightSync={"bucketMb": 4}), "spec.weightSync.bucketMb",
     ["backend", "bucketMB", "snapshot", "timeoutSeconds", "verify"]),
]


BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [" + ", ".join([f"*{chr(ord('a') + i - 1)}"] * 9) + "]"
       for i in range(1, 9)]
) + "\n"


# A valid job padded with a comment to one byte over the cap.
OVERSIZED = yaml.safe_dump(job()) + "#" * (MAX_JOB_BYTES - len(yaml.safe_dump(job()))) + "\n"

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
    ("deep-nesting", "metadata: " + "[" * 2000 + "]" * 2000 + "\n", "<file>"),
    ("integer-5000-digits", "metadata: {name: t}\nspec: {algorithm: {steps: 1" + "0" * 5000 + "}}\n", "<file>"),
    # YAML 1.1 integers in bases that Python converts without its 4,300-digit limit: refused by the schema, named.
    ("integer-5000-hex-digits", "metadata: {name: t}\nspec: {algorithm: {steps: 0x" + "f" * 5000 + "}}\n",
     "spec.algorithm.steps"),
    ("integer-20000-binary-digits", "metadata: {name: t}\nspec: {algorithm: {steps: 0b1" + "0" * 20000 + "}}\n",
     "spec.algorithm.steps"),
    ("date-13th-month", "metadata: {name: t}\nspec: {suspend: 2001-13-01}\n", "<file>"),
    ("date-as-name", "metadata: {name: 2001-12-14}\n", "metadata.name"),
    ("two-documents", "metadata: {name: t}\n---\nmetadata: {name: u}\n", "<file>"),
    ("nul-character", "metadata: {name: t\x00}\n", "<file>"),
    ("not-utf8", b"metadata: {name: \xff\xfe}\n", "<file>"),
    ("over-one-mebibyte", OVERSIZED, "<file>"),
]


class _Dumper(yaml.SafeDumper):
    """Writes repeated objects out in full: a loaded job refuses aliases (`[x] * 33` would dump as `*id001`)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def files() -> list[tuple[str, str | bytes, str]]:
    """Every entry as a job file `(id, content, path)`: what `rlfleet run` reads."""
    documents = [(c[0], yaml.dump(c[1], Dumper=_Dumper), c[2]) for c in BAD_JOBS + UNKNOWN_FIELDS]
    return documents + list(BAD_TEXTS)


# What a Kubernetes API server stores as a custom resource's name (DNS-1123 subdomain).
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def kubernetes_objects() -> list[tuple[str, str, Any, str]]:
    """The entries a Kubernetes API server would store as an RLJob and hand to the operator, as
    `(id, name, spec, path)`; a job named `t` is renamed after its id so that all can coexist.

    Left out: files (kubectl parses them), other kinds and apiVersions, unknown top-level fields and names the
    server refuses itself. Kept: every bad spec, even those the CRD schema would refuse, because the operator
    must not rely on that schema (it may be stale or bypassed).
    """
    chosen = []
    for id_, document, path, *_ in BAD_JOBS + UNKNOWN_FIELDS:
        if not isinstance(document, dict) or set(document) - {"apiVersion", "kind", "metadata", "spec"}:
            continue
        metadata = document.get("metadata")
        if document.get("apiVersion", API_VERSION) != API_VERSION or document.get("kind", KIND) != KIND \
                or not isinstance(metadata, dict) or set(metadata) != {"name"}:
            continue
        name = metadata["name"]
        if not isinstance(name, str) or len(name) > 253 or not K8S_NAME.fullmatch(name):
            continue
        chosen.append((id_, id_ if name == "t" else name, document.get("spec", {}), path))
    return chosen
