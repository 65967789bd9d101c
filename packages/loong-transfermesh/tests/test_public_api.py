"""The public surface of loong_transfermesh is deliberate: adding or removing a name updates this list."""

import loong_transfermesh


def test_exports_are_pinned():
    assert sorted(loong_transfermesh.__all__) == [
        "ManifestMismatch",
        "MegatronLayout",
        "SGLangPusherConfig",
        "SGLangUpdateError",
        "SGLangWeightPusher",
        "ShmReceiver",
        "ShmSender",
        "TcpReceiver",
        "TcpSender",
        "TransferFailed",
        "TransportConfig",
        "WeightReceiver",
        "WeightSender",
        "build_manifest",
        "check_against",
        "megatron_to_hf",
        "open_receiver",
        "open_sender",
        "remove_slots",
    ]


def test_every_export_resolves():
    for name in loong_transfermesh.__all__:
        assert getattr(loong_transfermesh, name) is not None, name
