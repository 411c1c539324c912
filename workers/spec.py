"""The RLJob schema: the one job description shared by the operator, the planner and every worker.

Torch-free on purpose (the operator imports it); a unit test proves it.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlfleet.workers.controller.config import ControllerRole
from rlfleet.workers.critic.config import CriticRole
from rlfleet.workers.data.config import ArithmeticData, DataSpec
from rlfleet.workers.environment.config import EnvironmentRole
from rlfleet.workers.evaluation.config import Evaluation
from rlfleet.workers.generator.config import Generation, GeneratorRole
from rlfleet.workers.generator.pools import generator_pools
from rlfleet.workers.models.config import ModelSpec, TinyModel
from rlfleet.workers.reference.config import ReferenceRole
from rlfleet.workers.reward_model.config import RewardModelRole
from rlfleet.workers.rl.config import Algorithm
from rlfleet.workers.roles import Role
from rlfleet.workers.scorer.config import MathAnswer, ScorerSpec
from rlfleet.workers.storage.config import Storage
from rlfleet.workers.strict import Strict
from rlfleet.workers.sync.config import WeightSync
from rlfleet.workers.tracking.config import TrackerSpec
from rlfleet.workers.trainer.config import Checkpoint, TrainerRole, Training

API_VERSION = "rlfleet.io/v1alpha1"
KIND = "RLJob"
# A job file is a few kB; the cap keeps a hostile file from exhausting memory before validation.
MAX_JOB_BYTES = 1 << 20
DNS_LABEL = r"^[a-z]([-a-z0-9]{0,40}[a-z0-9])?$"
# The rest of a ConfigMap's 1 MiB holds the job's other fields and the endpoints.
MAX_SOURCES_JSON_BYTES = 768 * 1024


class SpecError(ValueError):
    """A job that does not validate; `problems` holds one 'field.path: what is allowed' line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid RLJob:\n  " + "\n  ".join(problems))


class Roles(Strict):
    generator: GeneratorRole = Field(default_factory=GeneratorRole)
    trainer: TrainerRole = Field(default_factory=TrainerRole)
    scorer: Role = Field(default_factory=Role)
    reference: ReferenceRole | None = None
    """The reference policy executor (log pi_ref for the KL); none by default."""
    reward_model: RewardModelRole | None = None
    """A learned reward model executor (role id `reward`), its score added to the rule scorers'; none by default."""
    critic: CriticRole | None = None
    """The value model executor for GAE advantages (algorithm.advantage: gae); none by default."""
    environment: EnvironmentRole | None = None
    """The environment executor (role id `env`): multi-turn episodes with tools or an environment of your own, instead
    of single completions; none by default."""
    controller: ControllerRole | None = None
    """The controller as an executor of its own (role id `control`), a leader and a standby; none by default: the
    controller then runs in trainer rank 0."""


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
    def _pipeline_fits_the_model(self) -> RLJobSpec:
        stages = self.roles.trainer.pipeline_parallel
        if stages > 1 and self.training.lora:
            raise ValueError("roles.trainer.pipelineParallel > 1 trains every weight: LoRA adapters are not cut into "
                             "stages yet; remove training.lora, or set pipelineParallel to 1")
        if self.model.type == "tiny" and stages > self.model.num_layers:  # other models' layers: at the trainer's start
            raise ValueError(f"roles.trainer.pipelineParallel ({stages}) exceeds model.numLayers "
                             f"({self.model.num_layers}): each stage needs a decoder layer")
        return self

    @model_validator(mode="after")
    def _fp8_in_bfloat16(self) -> RLJobSpec:
        quantization = self.roles.generator.quantization
        if quantization.startswith("fp8") and self.model.dtype == "float32":
            raise ValueError(f"roles.generator.quantization {quantization} quantizes bfloat16 weights (vLLM): set "
                             "model.dtype bfloat16 (or auto), or choose int8")
        return self

    @model_validator(mode="after")
    def _kl_has_a_reference(self) -> RLJobSpec:
        if self.algorithm.kl.coef > 0 and self.roles.reference is None:
            raise ValueError("algorithm.kl.coef > 0 needs the reference executor: add spec.roles.reference "
                             "(e.g. `reference: {replicas: 1}`), or set algorithm.kl.coef to 0")
        return self

    @model_validator(mode="after")
    def _gae_has_a_critic(self) -> RLJobSpec:
        gae = self.algorithm.advantage == "gae"
        if gae and self.roles.critic is None:
            raise ValueError("algorithm.advantage gae needs the critic executor: add spec.roles.critic "
                             "(e.g. `critic: {replicas: 1}`), or choose another algorithm.advantage")
        if self.roles.critic is not None and not gae:
            raise ValueError(f"spec.roles.critic is only used by algorithm.advantage gae (it is "
                             f"{self.algorithm.advantage}): set algorithm.advantage to gae, or remove roles.critic")
        return self

    @model_validator(mode="after")
    def _episodes_are_not_guided(self) -> RLJobSpec:
        if self.roles.environment is not None and self.algorithm.guidance == "answer":
            raise ValueError("algorithm.guidance answer replaces a completion by the worked solution, which a "
                             "multi-turn episode of spec.roles.environment does not have: set guidance to auto or "
                             "none, or remove roles.environment")
        return self

    @model_validator(mode="after")
    def _hotter_samples_are_weighed(self) -> RLJobSpec:
        if self.generation.adaptive_temperature is None:
            return self
        loss, kl = self.algorithm.loss, self.algorithm.kl
        fix = "or remove generation.adaptiveTemperature"
        if loss.type == "reinforce" and loss.correction == "none":
            raise ValueError("generation.adaptiveTemperature samples hotter than the policy trains at, and "
                             "algorithm.loss reinforce with correction none would train on those samples as if the "
                             f"policy had drawn them: set algorithm.loss.correction to tis or mis, {fix}")
        if kl.coef > 0 and kl.use == "reward":
            raise ValueError("algorithm.kl.use reward penalises each sample's log mu, which a hotter sample's "
                             f"generation.adaptiveTemperature changes: set algorithm.kl.use to loss, {fix}")
        if self.roles.environment is not None and self.roles.environment.type == "agent":
            raise ValueError("an agent (spec.roles.environment type agent) samples through the generators' OpenAI "
                             f"endpoint at the temperature it asks for, which generation.adaptiveTemperature cannot "
                             f"set: {fix}")
        return self

    @model_validator(mode="after")
    def _reward_code_fits(self) -> RLJobSpec:
        # As job.json holds it: JSON-escaped, in the ConfigMap that Kubernetes caps at 1 MiB.
        code = [*self.scorers, self.roles.environment]
        size = sum(len(json.dumps(c.source)) for c in code if getattr(c, "source", None))
        if size > MAX_SOURCES_JSON_BYTES:
            raise ValueError(f"spec: the python scorers' and environment's sources take {size} bytes in the job's "
                             f"ConfigMap (JSON-escaped): at most {MAX_SOURCES_JSON_BYTES}; install larger code in the "
                             "image and name it by `module`")
        return self

    @model_validator(mode="after")
    def _gym_scorer_has_gym_data(self) -> RLJobSpec:
        if self.data.type != "reasoning_gym" and any(s.type == "reasoning_gym" for s in self.scorers):
            raise ValueError("spec.scorers: type reasoning_gym grades reasoning-gym's own problems by their metadata: "
                             f"set data.type reasoning_gym (it is {self.data.type}), or choose another scorer")
        return self

    @model_validator(mode="after")
    def _pools_resolve(self) -> RLJobSpec:
        generator_pools(self)  # a pool's tensor parallelism against its GPUs and the model's size
        return self

    @model_validator(mode="after")
    def _something_to_evaluate(self) -> RLJobSpec:
        if self.evaluation.every_steps and not self.data.held_out:
            raise ValueError("evaluation.everySteps needs held-out prompts: set data.heldOut above 0, or "
                             "evaluation.everySteps to 0")
        return self


def guided(spec: RLJobSpec) -> bool:
    """Whether groups that scored nothing may learn their example's solution (the Guidance stage runs). auto stays
    off where it cannot go: under kl.use reward (a guide has no sampling log-probs), in an environment's episodes (no
    worked solution), and with a learned reward model, whose scores at or below 0 do not mean that nothing was
    found."""
    algorithm, roles = spec.algorithm, spec.roles
    if algorithm.guidance != "auto":
        return algorithm.guidance == "answer"
    return algorithm.kl.use != "reward" and roles.environment is None and roles.reward_model is None


def uncorrected_quantization(spec: RLJobSpec) -> str | None:
    """Why the job's quantized generation goes uncorrected, or None: a quantized generator's log mu is not the
    trainer's log pi at equal versions, and only a loss with importance weights (every one but reinforce with
    correction none) corrects the difference."""
    generator, loss = spec.roles.generator, spec.algorithm.loss
    if generator.quantization == "none" and generator.kv_cache_dtype == "auto":
        return None
    if loss.type != "reinforce" or loss.correction != "none":
        return None
    return (f"roles.generator quantizes (quantization {generator.quantization}, kvCacheDtype "
            f"{generator.kv_cache_dtype}) but algorithm.loss is reinforce with correction none: nothing corrects the "
            "log-prob gap between the quantized generators and the trainer; set algorithm.loss.correction to tis or "
            "mis, or choose another loss")


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

    @model_validator(mode="after")
    def _pool_names_fit(self) -> RLJob:
        # <job>-generator-<pool> must leave a StatefulSet's name the 52 characters its revision label allows.
        for pool in self.spec.roles.generator.pools:
            if len(self.metadata.name) + 1 + len(pool.name) > 42:
                raise ValueError(f"spec.roles.generator.pools: metadata.name and pool name {pool.name!r} together "
                                 "exceed 41 characters (they name the pool's pods): shorten one")
        return self

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
    return f"{path}: {error['msg']} (got {_shown(given)})"


def _shown(given: Any) -> str:
    """At most 60 characters of a refused value; str() of an integer past 4,300 digits raises (Python's limit)."""
    if isinstance(given, str):
        return repr(given[:60])
    if isinstance(given, int) and given.bit_length() > 196:  # more than 59 decimal digits
        return f"an integer of {given.bit_length()} bits"
    return str(given)[:60]


def _is_union_tag(loc: tuple[Any, ...], index: int) -> bool:
    """pydantic puts the chosen variant's tag in the path right after a union field; users never wrote it."""
    return (_union_field(loc, index), loc[index]) in _VARIANTS


def _union_field(loc: tuple[Any, ...], index: int) -> str | None:
    """The union field (or list of unions) that the part at `index` would be the tag of, if any."""
    before = loc[index - 1] if index else None
    if before in _UNION_FIELDS:
        return before
    if isinstance(before, int) and index >= 2 and loc[index - 2] in _UNION_LISTS:
        return loc[index - 2]
    return None


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RLJob
    key_next = False  # a dict's key (data.datasets.NAME) names no field
    for index, part in enumerate(loc[:-1]):
        if isinstance(part, int) or key_next:
            key_next = False
            continue
        if _is_union_tag(loc, index):
            model = _VARIANTS[_union_field(loc, index), part]
            continue
        field = _field_by_alias(model, part)
        model = _section_of(field.annotation) if field else None
        key_next = field is not None and get_origin(field.annotation) is dict
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


def _tagged(annotation: Any) -> tuple[Any, ...]:
    """The variants of a tagged union written `Annotated[Union[...], Field(discriminator=...)]`, else ()."""
    if get_origin(annotation) is Annotated:
        inner, *metadata = get_args(annotation)
        if any(getattr(item, "discriminator", None) for item in metadata):
            return get_args(inner)
    return ()


def _unions(model: Any, variants: dict[tuple[str, str], Any], fields: set[str], lists: set[str]) -> None:
    """Every tagged union below `model`: its variants by (field, tag), since two unions may share a tag (data's and
    scorers' reasoning_gym), and the fields (or lists) holding one."""
    for name, field in model.model_fields.items():
        alias, members = field.alias or name, ()
        if field.discriminator:
            members = get_args(field.annotation)
            fields.add(alias)
        elif get_origin(field.annotation) is list and (members := _tagged(get_args(field.annotation)[0])):
            lists.add(alias)
        variants |= {(alias, member.model_fields["type"].default): member for member in members}
        for section in members or (_section_of(field.annotation),):
            if section is not None and section is not model:
                _unions(section, variants, fields, lists)


# Where pydantic puts the chosen variant's tag in error paths: found in the schema, so a new union needs no edit here.
_VARIANTS: dict[tuple[str, str], Any] = {}
_UNION_FIELDS: set[str] = set()
_UNION_LISTS: set[str] = set()
_unions(RLJob, _VARIANTS, _UNION_FIELDS, _UNION_LISTS)
