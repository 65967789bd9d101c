"""The public surface of loong_transfermesh is deliberate: adding or removing a name updates this list."""

import loong_transfermesh


def test_exports_are_pinned():
    assert sorted(loong_transfermesh.__all__) == [
        "LoraMerge",
        "ManifestMismatch",
        "MegatronLayout",
        "SGLangPusherConfig",
        "SGLangServers",
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
        "adapter_names",
        "adapter_shapes",
        "build_manifest",
        "catch_up",
        "check_against",
        "copy_adapter",
        "megatron_to_hf",
        "open_receiver",
        "open_sender",
        "remove_slots",
    ]


def test_every_export_resolves():
    for name in loong_transfermesh.__all__:
        assert getattr(loong_transfermesh, name) is not None, name


def test_exports_are_lazy_and_configs_import_no_torch():
    """Every name in ``__all__`` is in the lazy map and back; ``loong_transfermesh.config`` (the
    ``[transport]`` table a recipe validates against) loads no torch."""
    import subprocess
    import sys

    assert sorted(dir(loong_transfermesh)) == sorted(loong_transfermesh.__all__)
    code = "import sys, loong_transfermesh, loong_transfermesh.config; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )
