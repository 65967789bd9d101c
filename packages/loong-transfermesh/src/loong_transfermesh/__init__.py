"""Loong TransferMesh: move trainer weights into inference engines, bucketed and versioned."""

from loong_transfermesh.manifest import ManifestMismatch, build_manifest, check_against
from loong_transfermesh.shm import ShmReceiver, ShmSender, remove_slots

__all__ = [
    # transports
    "ShmReceiver",
    "ShmSender",
    "remove_slots",
    # manifests
    "ManifestMismatch",
    "build_manifest",
    "check_against",
]
