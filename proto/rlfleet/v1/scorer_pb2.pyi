from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("sample_id", "prompt", "completion", "answer", "fields_json")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt: str
    completion: str
    answer: str
    fields_json: str
    def __init__(self, sample_id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., answer: _Optional[str] = ..., fields_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("job_id", "items")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, job_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class Score(_message.Message):
    __slots__ = ("sample_id", "reward", "errors", "reasons", "scorer_scores", "components")
    class ScorerScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    SCORER_SCORES_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    reward: float
    errors: _containers.RepeatedScalarFieldContainer[str]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    scorer_scores: _containers.ScalarMap[str, float]
    components: _containers.ScalarMap[str, float]
    def __init__(self, sample_id: _Optional[str] = ..., reward: _Optional[float] = ..., errors: _Optional[_Iterable[str]] = ..., reasons: _Optional[_Iterable[str]] = ..., scorer_scores: _Optional[_Mapping[str, float]] = ..., components: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("job_id", "scores")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    scores: _containers.RepeatedCompositeFieldContainer[Score]
    def __init__(self, job_id: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[Score, _Mapping]]] = ...) -> None: ...
