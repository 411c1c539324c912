from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainSample(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids", "gen_logprobs", "sampled", "trained", "ref_logprobs", "advantage", "token_advantages")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    GEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    gen_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled: _containers.RepeatedScalarFieldContainer[bool]
    trained: _containers.RepeatedScalarFieldContainer[bool]
    ref_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantage: float
    token_advantages: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., gen_logprobs: _Optional[_Iterable[float]] = ..., sampled: _Optional[_Iterable[bool]] = ..., trained: _Optional[_Iterable[bool]] = ..., ref_logprobs: _Optional[_Iterable[float]] = ..., advantage: _Optional[float] = ..., token_advantages: _Optional[_Iterable[float]] = ...) -> None: ...

class TrainerTrainRequest(_message.Message):
    __slots__ = ("job_id", "step", "samples", "step_samples")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    samples: _containers.RepeatedCompositeFieldContainer[TrainSample]
    step_samples: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[TrainSample, _Mapping]]] = ..., step_samples: _Optional[int] = ...) -> None: ...

class TrainerTrainResponse(_message.Message):
    __slots__ = ("job_id", "step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("job_id", "role", "replica", "host", "port", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    replica: int
    host: str
    port: int
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., replica: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("job_id", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    error: str
    def __init__(self, job_id: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ArrivedRequest(_message.Message):
    __slots__ = ("job_id", "role", "replica", "host", "port", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    replica: int
    host: str
    port: int
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., replica: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ArrivedResponse(_message.Message):
    __slots__ = ("job_id", "arrived")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    arrived: bool
    def __init__(self, job_id: _Optional[str] = ..., arrived: _Optional[bool] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("job_id", "role", "replicas")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("job_id", "pack_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PACK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    pack_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., pack_seconds: _Optional[float] = ...) -> None: ...

class TrainerCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "step", "state_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    state_json: str
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., state_json: _Optional[str] = ...) -> None: ...

class TrainerCheckpointResponse(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("job_id", "step", "state_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    state_json: str
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., state_json: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("job_id", "snapshot")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    snapshot: int
    def __init__(self, job_id: _Optional[str] = ..., snapshot: _Optional[int] = ...) -> None: ...

class SaveBestRequest(_message.Message):
    __slots__ = ("job_id", "snapshot", "state_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    snapshot: int
    state_json: str
    def __init__(self, job_id: _Optional[str] = ..., snapshot: _Optional[int] = ..., state_json: _Optional[str] = ...) -> None: ...

class SaveBestResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class PushShape(_message.Message):
    __slots__ = ("name", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("job_id", "world_size", "push_shapes", "best_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PUSH_SHAPES_FIELD_NUMBER: _ClassVar[int]
    BEST_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    push_shapes: _containers.RepeatedCompositeFieldContainer[PushShape]
    best_json: str
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., push_shapes: _Optional[_Iterable[_Union[PushShape, _Mapping]]] = ..., best_json: _Optional[str] = ...) -> None: ...

class IdleRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class IdleResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...
