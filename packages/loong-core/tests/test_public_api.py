"""The public surface of loong_core is deliberate: adding or removing a name updates this list."""

import loong_core


def test_exports_are_pinned():
    assert sorted(loong_core.__all__) == [
        "ConfigError",
        "EpisodeStatus",
        "MetricsWriter",
        "RolloutEngine",
        "SamplingParams",
        "SpanSource",
        "StalenessWindow",
        "TensorEntry",
        "TokenSpan",
        "TraceWriter",
        "TrainBatch",
        "Trajectory",
        "WeightManifest",
        "WindowStats",
        "decode",
        "dump_toml",
        "encode",
        "load_config",
        "read_metrics",
    ]


def test_every_export_resolves():
    for name in loong_core.__all__:
        assert getattr(loong_core, name) is not None, name
