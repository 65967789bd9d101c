"""Loong core: the records, protocols, config loading, staleness window, telemetry, SGLang HTTP
API bodies and free-port helper shared by every Loong package. Pure Python plus msgspec:
importing it never pulls in torch or ray."""

from loong_core.config import ConfigError, dump_toml, load_config
from loong_core.net import free_port
from loong_core.protocols import RequestRefused, RolloutEngine, SamplingParams
from loong_core.records import (
    EpisodeStatus,
    SpanSource,
    TensorEntry,
    TokenSpan,
    TrainBatch,
    Trajectory,
    WeightManifest,
    decode,
    encode,
)
from loong_core.sglang_api import (
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    ErrorResponse,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    MetaInfo,
    ModelInfoResponse,
    PauseGenerationRequest,
    SGLangSamplingParams,
    StatusResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
    WeightVersionResponse,
)
from loong_core.telemetry import MetricsWriter, TraceWriter, read_metrics
from loong_core.window import StalenessWindow, WindowStats

__all__ = [
    # records
    "EpisodeStatus",
    "SpanSource",
    "TensorEntry",
    "TokenSpan",
    "TrainBatch",
    "Trajectory",
    "WeightManifest",
    "decode",
    "encode",
    # protocols
    "RequestRefused",
    "RolloutEngine",
    "SamplingParams",
    # config
    "ConfigError",
    "dump_toml",
    "load_config",
    # network
    "free_port",
    # staleness window
    "StalenessWindow",
    "WindowStats",
    # telemetry
    "MetricsWriter",
    "TraceWriter",
    "read_metrics",
    # SGLang HTTP API bodies (loong_core.sglang_api)
    "ContinueGenerationRequest",
    "DestroyWeightsUpdateGroupRequest",
    "ErrorResponse",
    "FinishReason",
    "GenerateRequest",
    "GenerateResponse",
    "GetWeightsByNameRequest",
    "InitWeightsUpdateGroupRequest",
    "MetaInfo",
    "ModelInfoResponse",
    "PauseGenerationRequest",
    "SGLangSamplingParams",
    "StatusResponse",
    "UpdateWeightsFromDiskRequest",
    "UpdateWeightsFromDistributedRequest",
    "UpdateWeightsFromTensorRequest",
    "UpdateWeightsResponse",
    "WeightVersionResponse",
]
