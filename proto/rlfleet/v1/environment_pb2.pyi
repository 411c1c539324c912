from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EpisodeStart(_message.Message):
    __slots__ = ("episode_id", "example_json")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_JSON_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    example_json: str
    def __init__(self, episode_id: _Optional[str] = ..., example_json: _Optional[str] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("job_id", "episodes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeStart]
    def __init__(self, job_id: _Optional[str] = ..., episodes: _Optional[_Iterable[_Union[EpisodeStart, _Mapping]]] = ...) -> None: ...

class Opening(_message.Message):
    __slots__ = ("episode_id", "prompt_ids", "error")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, episode_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("job_id", "openings")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OPENINGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    openings: _containers.RepeatedCompositeFieldContainer[Opening]
    def __init__(self, job_id: _Optional[str] = ..., openings: _Optional[_Iterable[_Union[Opening, _Mapping]]] = ...) -> None: ...

class PolicyTurn(_message.Message):
    __slots__ = ("episode_id", "token_ids")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, episode_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("job_id", "turns")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    turns: _containers.RepeatedCompositeFieldContainer[PolicyTurn]
    def __init__(self, job_id: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[PolicyTurn, _Mapping]]] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("episode_id", "token_ids", "restart_ids", "done", "reward", "tool_calls", "tool_errors", "error", "seconds")
    class ToolCallsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ToolErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESTART_IDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    restart_ids: _containers.RepeatedScalarFieldContainer[int]
    done: bool
    reward: float
    tool_calls: _containers.ScalarMap[str, int]
    tool_errors: _containers.ScalarMap[str, int]
    error: str
    seconds: float
    def __init__(self, episode_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., restart_ids: _Optional[_Iterable[int]] = ..., done: _Optional[bool] = ..., reward: _Optional[float] = ..., tool_calls: _Optional[_Mapping[str, int]] = ..., tool_errors: _Optional[_Mapping[str, int]] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("job_id", "observations")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    observations: _containers.RepeatedCompositeFieldContainer[Observation]
    def __init__(self, job_id: _Optional[str] = ..., observations: _Optional[_Iterable[_Union[Observation, _Mapping]]] = ...) -> None: ...

class EndRequest(_message.Message):
    __slots__ = ("job_id", "episode_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    episode_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., episode_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EndResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class PlayRequest(_message.Message):
    __slots__ = ("job_id", "episode_id", "example_json", "base_url")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_JSON_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    episode_id: str
    example_json: str
    base_url: str
    def __init__(self, job_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., example_json: _Optional[str] = ..., base_url: _Optional[str] = ...) -> None: ...

class TurnRecord(_message.Message):
    __slots__ = ("kind", "token_ids", "logprobs", "versions")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleRecord(_message.Message):
    __slots__ = ("prompt_ids", "turns")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    turns: _containers.RepeatedCompositeFieldContainer[TurnRecord]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., turns: _Optional[_Iterable[_Union[TurnRecord, _Mapping]]] = ...) -> None: ...

class PlayResponse(_message.Message):
    __slots__ = ("job_id", "episode_id", "samples", "reward", "error", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    episode_id: str
    samples: _containers.RepeatedCompositeFieldContainer[SampleRecord]
    reward: float
    error: str
    seconds: float
    def __init__(self, job_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[SampleRecord, _Mapping]]] = ..., reward: _Optional[float] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
