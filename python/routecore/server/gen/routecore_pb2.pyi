from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MeasuredRequest(_message.Message):
    __slots__ = ("prompt_bytes", "category", "max_output_tokens", "prompt_tokens")
    PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_bytes: int
    category: str
    max_output_tokens: int
    prompt_tokens: int
    def __init__(self, prompt_bytes: _Optional[int] = ..., category: _Optional[str] = ..., max_output_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("body", "measured", "api_key", "token_ids")
    BODY_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    measured: MeasuredRequest
    api_key: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, body: _Optional[bytes] = ..., measured: _Optional[_Union[MeasuredRequest, _Mapping]] = ..., api_key: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("admitted", "status", "reason", "retry_after_s")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    admitted: bool
    status: int
    reason: str
    retry_after_s: float
    def __init__(self, admitted: _Optional[bool] = ..., status: _Optional[int] = ..., reason: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("request_id", "pool", "endpoint", "est_input_tokens", "est_output_tokens", "est_total_tokens", "spilled", "reason", "admission", "compress_target_tokens", "compressed_body", "prefill_endpoint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EST_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EST_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EST_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_BODY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool: str
    endpoint: str
    est_input_tokens: int
    est_output_tokens: int
    est_total_tokens: int
    spilled: bool
    reason: str
    admission: Admission
    compress_target_tokens: int
    compressed_body: bytes
    prefill_endpoint: str
    def __init__(self, request_id: _Optional[str] = ..., pool: _Optional[str] = ..., endpoint: _Optional[str] = ..., est_input_tokens: _Optional[int] = ..., est_output_tokens: _Optional[int] = ..., est_total_tokens: _Optional[int] = ..., spilled: _Optional[bool] = ..., reason: _Optional[str] = ..., admission: _Optional[_Union[Admission, _Mapping]] = ..., compress_target_tokens: _Optional[int] = ..., compressed_body: _Optional[bytes] = ..., prefill_endpoint: _Optional[str] = ...) -> None: ...

class FeedbackRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "completion_tokens", "latency_s", "api_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    api_key: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., latency_s: _Optional[float] = ..., api_key: _Optional[str] = ...) -> None: ...

class FeedbackResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("params_json",)
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    params_json: str
    def __init__(self, params_json: _Optional[str] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("plan_json",)
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    plan_json: str
    def __init__(self, plan_json: _Optional[str] = ...) -> None: ...

class AutoscaleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolAutoscale(_message.Message):
    __slots__ = ("pool", "desired_endpoints", "target_endpoints", "model_endpoints", "reason", "binding", "rate", "observed_rate", "queued_rate", "promised_rate", "prompt_tokens_p50", "prompt_tokens_p99", "output_tokens_p50", "output_tokens_p99", "explanation")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DESIRED_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_RATE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_RATE_FIELD_NUMBER: _ClassVar[int]
    PROMISED_RATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_P50_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_P99_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_P50_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_P99_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    pool: str
    desired_endpoints: int
    target_endpoints: int
    model_endpoints: int
    reason: str
    binding: str
    rate: float
    observed_rate: float
    queued_rate: float
    promised_rate: float
    prompt_tokens_p50: int
    prompt_tokens_p99: int
    output_tokens_p50: int
    output_tokens_p99: int
    explanation: str
    def __init__(self, pool: _Optional[str] = ..., desired_endpoints: _Optional[int] = ..., target_endpoints: _Optional[int] = ..., model_endpoints: _Optional[int] = ..., reason: _Optional[str] = ..., binding: _Optional[str] = ..., rate: _Optional[float] = ..., observed_rate: _Optional[float] = ..., queued_rate: _Optional[float] = ..., promised_rate: _Optional[float] = ..., prompt_tokens_p50: _Optional[int] = ..., prompt_tokens_p99: _Optional[int] = ..., output_tokens_p50: _Optional[int] = ..., output_tokens_p99: _Optional[int] = ..., explanation: _Optional[str] = ...) -> None: ...

class AutoscaleResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolAutoscale]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolAutoscale, _Mapping]]] = ...) -> None: ...
