from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParamShape(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinSyncGroupRequest(_message.Message):
    __slots__ = ("job_id", "store_host", "store_port", "trainers", "backend", "timeout_seconds", "dtype", "bucket_bytes", "params", "epoch", "verify", "pipeline_stages")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    store_host: str
    store_port: int
    trainers: int
    backend: str
    timeout_seconds: float
    dtype: str
    bucket_bytes: int
    params: _containers.RepeatedCompositeFieldContainer[ParamShape]
    epoch: int
    verify: bool
    pipeline_stages: int
    def __init__(self, job_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., trainers: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., dtype: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., params: _Optional[_Iterable[_Union[ParamShape, _Mapping]]] = ..., epoch: _Optional[int] = ..., verify: _Optional[bool] = ..., pipeline_stages: _Optional[int] = ...) -> None: ...

class JoinSyncGroupResponse(_message.Message):
    __slots__ = ("job_id", "tensor_parallel_size")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tensor_parallel_size: int
    def __init__(self, job_id: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("job_id", "policy_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_version: int
    def __init__(self, job_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("job_id", "policy_version", "receive_seconds", "load_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_version: int
    receive_seconds: float
    load_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ...) -> None: ...
