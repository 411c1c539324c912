from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ValueSequence(_message.Message):
    __slots__ = ("sample_id", "prompt_ids", "completion_ids")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ValuesRequest(_message.Message):
    __slots__ = ("job_id", "sequences")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[ValueSequence]
    def __init__(self, job_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[ValueSequence, _Mapping]]] = ...) -> None: ...

class TokenValues(_message.Message):
    __slots__ = ("sample_id", "values")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sample_id: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class ValuesResponse(_message.Message):
    __slots__ = ("job_id", "critic_version", "sequences")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CRITIC_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    critic_version: int
    sequences: _containers.RepeatedCompositeFieldContainer[TokenValues]
    def __init__(self, job_id: _Optional[str] = ..., critic_version: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[TokenValues, _Mapping]]] = ...) -> None: ...

class ValueTarget(_message.Message):
    __slots__ = ("sequence", "returns", "old_values")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    sequence: ValueSequence
    returns: _containers.RepeatedScalarFieldContainer[float]
    old_values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sequence: _Optional[_Union[ValueSequence, _Mapping]] = ..., returns: _Optional[_Iterable[float]] = ..., old_values: _Optional[_Iterable[float]] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("job_id", "step", "targets", "step_targets")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    STEP_TARGETS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    targets: _containers.RepeatedCompositeFieldContainer[ValueTarget]
    step_targets: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[ValueTarget, _Mapping]]] = ..., step_targets: _Optional[int] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("job_id", "critic_version", "value_loss", "value_clip_fraction", "explained_variance", "value_mean", "train_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CRITIC_VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EXPLAINED_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    VALUE_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    critic_version: int
    value_loss: float
    value_clip_fraction: float
    explained_variance: float
    value_mean: float
    train_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., critic_version: _Optional[int] = ..., value_loss: _Optional[float] = ..., value_clip_fraction: _Optional[float] = ..., explained_variance: _Optional[float] = ..., value_mean: _Optional[float] = ..., train_seconds: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("job_id", "critic_version", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CRITIC_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    critic_version: int
    step: int
    def __init__(self, job_id: _Optional[str] = ..., critic_version: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...
