from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenSequence(_message.Message):
    __slots__ = ("sample_id", "prompt_ids", "completion_ids")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogProbsRequest(_message.Message):
    __slots__ = ("job_id", "sequences")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, job_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenLogProbs(_message.Message):
    __slots__ = ("sample_id", "logprobs")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sample_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogProbsResponse(_message.Message):
    __slots__ = ("job_id", "policy_version", "sequences")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_version: int
    sequences: _containers.RepeatedCompositeFieldContainer[TokenLogProbs]
    def __init__(self, job_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[TokenLogProbs, _Mapping]]] = ...) -> None: ...
