from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sequence(_message.Message):
    __slots__ = ("sample_id", "prompt_ids", "completion_ids")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("job_id", "sequences", "max_tokens", "temperature", "top_p", "seed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    def __init__(self, job_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("sample_id", "token_ids", "logprobs", "finished")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    def __init__(self, sample_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("job_id", "segments", "policy_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    policy_version: int
    def __init__(self, job_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class GeneratorStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GeneratorStatusResponse(_message.Message):
    __slots__ = ("job_id", "policy_version", "busy_seconds", "idle_seconds", "tokens_generated")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_version: int
    busy_seconds: float
    idle_seconds: float
    tokens_generated: int
    def __init__(self, job_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., tokens_generated: _Optional[int] = ...) -> None: ...
