"""Loong TransferMesh: move trainer weights into inference engines, bucketed and versioned."""

from loong_core.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(  # the configs import no torch; the transports load it on first use
    __name__,
    {
        "loong_transfermesh.config": ["SGLangPusherConfig", "TransportConfig"],
        "loong_transfermesh.layout": ["MegatronLayout", "megatron_to_hf"],
        "loong_transfermesh.lora": ["LoraMerge", "adapter_names", "adapter_shapes", "copy_adapter"],
        "loong_transfermesh.manifest": [
            "ManifestMismatch",
            "TransferFailed",
            "build_manifest",
            "check_against",
        ],
        "loong_transfermesh.sglang": ["SGLangServers", "SGLangUpdateError", "SGLangWeightPusher"],
        "loong_transfermesh.shm": ["ShmReceiver", "ShmSender", "remove_slots"],
        "loong_transfermesh.tcp": ["TcpReceiver", "TcpSender"],
        "loong_transfermesh.transport": [
            "WeightReceiver",
            "WeightSender",
            "catch_up",
            "open_receiver",
            "open_sender",
        ],
    },
)

__all__ = [
    # the API
    "TransportConfig",
    "WeightReceiver",
    "WeightSender",
    "catch_up",
    "open_receiver",
    "open_sender",
    # transports
    "ShmReceiver",
    "ShmSender",
    "TcpReceiver",
    "TcpSender",
    "remove_slots",
    # SGLang servers
    "SGLangPusherConfig",
    "SGLangServers",
    "SGLangUpdateError",
    "SGLangWeightPusher",
    # adapter-only (LoRA) updates
    "LoraMerge",
    "adapter_names",
    "adapter_shapes",
    "copy_adapter",
    # layout conversion
    "MegatronLayout",
    "megatron_to_hf",
    # manifests
    "ManifestMismatch",
    "TransferFailed",
    "build_manifest",
    "check_against",
]
