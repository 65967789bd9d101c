"""The public surface of loong_core is deliberate: adding or removing a name updates this list."""

import loong_core


def test_exports_are_pinned():
    assert sorted(loong_core.__all__) == [
        "ConfigError",
        "ContinueGenerationRequest",
        "DestroyWeightsUpdateGroupRequest",
        "EpisodeStatus",
        "ErrorResponse",
        "FinishReason",
        "GenerateRequest",
        "GenerateResponse",
        "GetWeightsByNameRequest",
        "InitWeightsUpdateGroupRequest",
        "MetaInfo",
        "MetricsWriter",
        "ModelInfoResponse",
        "PauseGenerationRequest",
        "RequestRefused",
        "RolloutEngine",
        "SGLangSamplingParams",
        "SamplingParams",
        "SpanSource",
        "StalenessWindow",
        "StatusResponse",
        "TensorEntry",
        "TokenSpan",
        "TraceWriter",
        "TrainBatch",
        "Trajectory",
        "UpdateWeightsFromDiskRequest",
        "UpdateWeightsFromDistributedRequest",
        "UpdateWeightsFromTensorRequest",
        "UpdateWeightsResponse",
        "WeightManifest",
        "WeightVersionResponse",
        "WindowStats",
        "decode",
        "dump_toml",
        "encode",
        "free_port",
        "load_config",
        "read_metrics",
    ]


def test_every_export_resolves():
    for name in loong_core.__all__:
        assert getattr(loong_core, name) is not None, name
