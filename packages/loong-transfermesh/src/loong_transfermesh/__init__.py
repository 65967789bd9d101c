"""Loong TransferMesh: move trainer weights into inference engines, bucketed and versioned."""

from loong_transfermesh.layout import MegatronLayout, megatron_to_hf
from loong_transfermesh.manifest import ManifestMismatch, TransferFailed, build_manifest, check_against
from loong_transfermesh.sglang import SGLangPusherConfig, SGLangUpdateError, SGLangWeightPusher
from loong_transfermesh.shm import ShmReceiver, ShmSender, remove_slots
from loong_transfermesh.tcp import TcpReceiver, TcpSender
from loong_transfermesh.transport import (
    TransportConfig,
    WeightReceiver,
    WeightSender,
    open_receiver,
    open_sender,
)

__all__ = [
    # the API
    "TransportConfig",
    "WeightReceiver",
    "WeightSender",
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
    "SGLangUpdateError",
    "SGLangWeightPusher",
    # layout conversion
    "MegatronLayout",
    "megatron_to_hf",
    # manifests
    "ManifestMismatch",
    "TransferFailed",
    "build_manifest",
    "check_against",
]
