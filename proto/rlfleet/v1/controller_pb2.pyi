from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ControllerStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ControllerStatusResponse(_message.Message):
    __slots__ = ("job_id", "phase", "step", "total_steps", "policy_version", "reward_mean", "samples_trained", "samples_dropped_stale", "tokens_generated")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: str
    step: int
    total_steps: int
    policy_version: int
    reward_mean: float
    samples_trained: int
    samples_dropped_stale: int
    tokens_generated: int
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., reward_mean: _Optional[float] = ..., samples_trained: _Optional[int] = ..., samples_dropped_stale: _Optional[int] = ..., tokens_generated: _Optional[int] = ...) -> None: ...
