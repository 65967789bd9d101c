"""Shared-memory transport: bit-exact round trips, slot alternation, all-or-nothing rejection of bad
manifests and corrupted buckets, slot clean-up, and a real second process as the receiver."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import pytest
import torch

from loong_transfermesh import ManifestMismatch, ShmReceiver, ShmSender, TransferFailed
from loong_transfermesh.shm import _SHM_DIR, _slot_path

torch.set_num_threads(1)

BUCKET = 256  # small, so the state below spans several buckets


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's values as bytes, in row-major order (independent of its strides)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    special = torch.randn(6, generator=g)
    special[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    return {
        "f32": torch.randn(3, 4, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (5,), generator=g),
        "scalar_f32": torch.randn((), generator=g),
        "scalar_i64": torch.tensor(int(torch.randint(0, 1000, (1,), generator=g))),
        "transposed": torch.randn(4, 3, generator=g).t(),  # non-contiguous source
        "big": torch.randn(100, generator=g),  # 400 B > one bucket
        "special": special,  # NaN, inf and -0.0 must survive bit for bit
        "bf16_2d": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16)[:, 1],  # strided slice
    }


def _zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}


def _snapshot(targets: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: _raw(v) for k, v in targets.items()}


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    for slot in (0, 1):  # clean up whatever a failing test left behind
        _slot_path(name, slot).unlink(missing_ok=True)


@pytest.fixture
def sender(name: str) -> Iterator[ShmSender]:
    s = ShmSender(name, bucket_bytes=BUCKET, checksum=True)
    yield s
    s.close()


def test_round_trip_is_bit_exact(name: str, sender: ShmSender) -> None:
    state = _state(0)
    assert not state["transposed"].is_contiguous() and not state["bf16_2d"].is_contiguous()
    manifest = sender.push(state, version=1)
    assert len(manifest.bucket_sizes) > 2 and len(manifest.checksums) == len(manifest.bucket_sizes)
    targets = _zeros_like(state)
    targets["f32"] = torch.zeros(4, 3).t()  # a non-contiguous target is filled correctly too
    receiver = ShmReceiver(name)
    assert receiver.apply(targets) == 1
    assert receiver.version == 1
    assert _snapshot(targets) == _snapshot(state)


def test_read_returns_views_of_the_slot(name: str, sender: ShmSender) -> None:
    state = _state(1)
    sender.push(state, version=4)
    views = ShmReceiver(name).read(4)
    assert list(views) == list(state)
    for k, v in views.items():
        assert (v.dtype, v.shape) == (state[k].dtype, state[k].shape)
        assert _raw(v) == _raw(state[k])


def test_versions_alternate_slots_and_both_stay_readable(name: str, sender: ShmSender) -> None:
    a, b, c = _state(10), _state(11), _state(12)
    sender.push(a, version=1)
    assert _slot_path(name, 1).exists() and not _slot_path(name, 0).exists()
    sender.push(b, version=2)
    assert _slot_path(name, 0).exists()
    receiver, targets = ShmReceiver(name), _zeros_like(a)
    # v1 is still intact in slot 1 after v2 was written to slot 0
    receiver.apply(targets, version=1)
    assert _snapshot(targets) == _snapshot(a)
    receiver.apply(targets)  # the newest: 2
    assert _snapshot(targets) == _snapshot(b)
    sender.push(c, version=3)  # slot 1 reused
    receiver.apply(targets, version=3)
    assert _snapshot(targets) == _snapshot(c) and receiver.version == 3
    assert _snapshot(targets) != _snapshot(b)


def test_a_slot_grows_when_an_update_is_larger(name: str, sender: ShmSender) -> None:
    small = {"w": torch.arange(4, dtype=torch.float32)}
    large = {"w": torch.arange(4, dtype=torch.float32) + 1, "extra": torch.arange(300, dtype=torch.int64)}
    receiver = ShmReceiver(name)
    t_small = _zeros_like(small)
    sender.push(small, version=1)
    receiver.apply(t_small)
    t_large = _zeros_like(large)
    sender.push(large, version=3)
    receiver.apply(t_large)
    assert _snapshot(t_small) == _snapshot(small)
    assert _snapshot(t_large) == _snapshot(large)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("special"), "tensor 'special' is not in the receiver's model"),
        (lambda t: t.update(special=torch.zeros(7)), r"tensor 'special': shape \[6\]"),
        (lambda t: t.update(special=torch.zeros(6, dtype=torch.float64)), "tensor 'special': dtype float32"),
        (lambda t: t.update(bf16_2d=torch.zeros(2, 4)), "tensor 'bf16_2d': dtype bfloat16"),
    ],
    ids=["missing", "shape", "dtype", "bf16-vs-f32"],
)
def test_mismatched_manifest_is_rejected_before_any_byte(
    name: str, sender: ShmSender, change, message: str
) -> None:
    state = _state(2)
    sender.push(state, version=1)
    targets = {k: torch.full(v.shape, 7).to(v.dtype) for k, v in state.items()}
    change(targets)
    before = _snapshot(targets)
    receiver = ShmReceiver(name)
    with pytest.raises(ManifestMismatch, match=message):
        receiver.apply(targets)
    assert _snapshot(targets) == before
    assert receiver.version == -1


def _data_offset(name: str, slot: int) -> int:
    """Where the buckets start in a slot file: header field 5 (int64, little-endian)."""
    with _slot_path(name, slot).open("rb") as f:
        return int.from_bytes(f.read(48)[40:48], "little")


def _flip_byte(name: str, slot: int, position: int) -> None:
    with _slot_path(name, slot).open("r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("corrupt", ["big", "scalar_i64", "bf16_2d"])
def test_corrupted_bucket_is_rejected_and_nothing_applied(name: str, sender: ShmSender, corrupt: str) -> None:
    state = _state(3)
    manifest = sender.push(state, version=1)
    entry = next(e for e in manifest.tensors if e.name == corrupt)
    position = (
        _data_offset(name, 1) + sum(manifest.bucket_sizes[: entry.bucket]) + entry.offset + entry.nbytes - 1
    )
    _flip_byte(name, slot=1, position=position)
    targets = _zeros_like(state)
    before = _snapshot(targets)
    with pytest.raises(ManifestMismatch, match=rf"bucket {entry.bucket} checksum mismatch"):
        ShmReceiver(name).apply(targets)
    assert _snapshot(targets) == before  # tensors of healthy buckets were not applied either


def test_corrupted_padding_is_caught_too(name: str, sender: ShmSender) -> None:
    state = {"a": torch.ones(3), "b": torch.ones(3)}  # a@0 (12 B), padding 12..63, b@64
    sender.push(state, version=2)
    _flip_byte(name, slot=0, position=_data_offset(name, 0) + 40)
    with pytest.raises(ManifestMismatch, match="bucket 0 checksum mismatch"):
        ShmReceiver(name).apply(_zeros_like(state))


def test_missing_slot_fails_cleanly(sender: ShmSender) -> None:
    sender.push(_state(4), version=1)
    with pytest.raises(TransferFailed, match="no version newer than -1"):
        ShmReceiver(f"absent-{uuid.uuid4().hex[:12]}").apply(_zeros_like(_state(4)))
    with pytest.raises(TransferFailed, match="no shared-memory slot"):
        ShmReceiver(f"absent-{uuid.uuid4().hex[:12]}", timeout_s=0.1).apply(_zeros_like(_state(4)), version=1)


def test_close_unlinks_the_slots(name: str) -> None:
    sender = ShmSender(name, bucket_bytes=BUCKET)
    sender.push(_state(5), version=1)
    sender.push(_state(6), version=2)
    assert sorted(p.name for p in _SHM_DIR.glob(f"loong-tm-{name}-*")) == [
        f"loong-tm-{name}-0",
        f"loong-tm-{name}-1",
    ]
    sender.close()
    assert list(_SHM_DIR.glob(f"loong-tm-{name}-*")) == []
    sender.close()  # idempotent


_MODEL_SRC = textwrap.dedent(
    """
    import hashlib
    import torch

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        model[3].to(torch.bfloat16)
        return model

    def digest(model):
        h = hashlib.sha256()
        for k, v in model.state_dict().items():
            h.update(k.encode())
            h.update(str(v.dtype).encode())
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    """
)

_CHILD = _MODEL_SRC + textwrap.dedent(
    """
    import sys
    from loong_transfermesh import ShmReceiver

    torch.set_num_threads(1)
    name = sys.argv[1]
    model = build(seed=1)
    print("before", digest(model))
    print("version", ShmReceiver(name).apply(model.state_dict()))
    print("after", digest(model))
    """
)


@pytest.mark.integration
def test_a_second_process_receives_a_bit_exact_model(name: str, sender: ShmSender) -> None:
    scope: dict = {}
    exec(_MODEL_SRC, scope)
    model = scope["build"](seed=0)
    model[1](torch.randn(5, 16))  # update BatchNorm running stats and its int64 counter
    want = scope["digest"](model)
    # independent of the helper above: hash of the same bytes done here
    manual = hashlib.sha256()
    for k, v in model.state_dict().items():
        manual.update(k.encode() + str(v.dtype).encode() + _raw(v))
    assert manual.hexdigest() == want

    sender.push(model.state_dict(), version=7)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, name],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    report = dict(line.split(" ", 1) for line in proc.stdout.decode().splitlines())
    assert report["before"] != want  # a different seed really gave different weights
    assert report["version"] == "7"
    assert report["after"] == want


def test_zero_copy_parameters_become_views_of_the_slot(name: str) -> None:
    sender = ShmSender(name, bucket_bytes=1 << 10)
    torch.manual_seed(0)
    trainer, engine = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    params = dict(engine.named_parameters())
    receiver = ShmReceiver(name, mode="zero_copy")
    x = torch.randn(3, 6)
    for version in (1, 2, 3):
        with torch.no_grad():
            trainer.weight.add_(0.5)  # a training step
        sender.push(dict(trainer.named_parameters()), version=version)
        assert receiver.apply(params) == version
        assert torch.equal(engine(x), trainer(x))
        assert engine.weight.untyped_storage().data_ptr() != trainer.weight.untyped_storage().data_ptr()
        slot_views = receiver.read(version)
        assert engine.weight.data_ptr() == slot_views["weight"].data_ptr()  # no copy was made
    assert engine.weight.requires_grad  # still a parameter
    sender.close()


def test_a_receiver_started_before_the_push_streams_it(name: str, sender: ShmSender) -> None:
    """apply waits for the header and then follows the bucket stamps while the sender writes."""
    import threading

    state, targets = _state(20), _zeros_like(_state(20))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(v=ShmReceiver(name).apply(targets, version=1)))
    thread.start()
    sender.push(state, version=1)
    thread.join(timeout=30)
    assert result == {"v": 1}
    assert _snapshot(targets) == _snapshot(state)


def test_a_late_receiver_gets_the_newest_version(name: str, sender: ShmSender) -> None:
    for version in (1, 2, 3, 4):
        sender.push(_state(30 + version), version=version)
    targets = _zeros_like(_state(0))
    assert ShmReceiver(name).apply(targets) == 4
    assert _snapshot(targets) == _snapshot(_state(34))


def test_an_overwritten_version_is_reported(name: str, sender: ShmSender) -> None:
    sender.push(_state(1), version=1)
    sender.push(_state(3), version=3)  # same slot
    with pytest.raises(TransferFailed, match="version 1 was overwritten by 3"):
        ShmReceiver(name, timeout_s=5).apply(_zeros_like(_state(1)), version=1)


def test_a_version_never_pushed_times_out(name: str, sender: ShmSender) -> None:
    sender.push(_state(1), version=1)
    targets = _zeros_like(_state(1))
    with pytest.raises(TransferFailed, match="timed out waiting for its manifest of version 5"):
        ShmReceiver(name, timeout_s=0.2).apply(targets, version=5)
    assert _snapshot(targets) == _snapshot(_zeros_like(_state(1)))


def test_without_checksums_the_stamps_still_stream_a_bit_exact_update(name: str) -> None:
    sender = ShmSender(name, bucket_bytes=BUCKET)  # the shm default: no checksums
    manifest = sender.push(_state(40), version=1)
    assert manifest.checksums == []
    targets = _zeros_like(_state(40))
    assert ShmReceiver(name).apply(targets) == 1
    assert _snapshot(targets) == _snapshot(_state(40))
    sender.close()


# -- the owner's reuse rule, as TransportConfig.must_have_applied states it -------------------------


def test_the_reuse_rule_is_what_the_slots_do(name: str, sender: ShmSender) -> None:
    """zero_copy: targets view the slot of the version they applied; pushing ``v`` is safe once they
    hold ``must_have_applied(v)``, and pushing past it rewrites the bytes they view."""
    from loong_transfermesh import TransportConfig

    rule = TransportConfig(name=name, mode="zero_copy").must_have_applied
    receiver = ShmReceiver(name, mode="zero_copy", timeout_s=5)
    params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in _zeros_like(_state(0)).items()}
    sender.push(_state(1), version=1)
    receiver.apply(params)
    assert rule(2) <= receiver.version
    sender.push(_state(2), version=2)  # allowed: the views keep version 1's bytes
    assert _snapshot({k: p.data for k, p in params.items()}) == _snapshot(_state(1))
    assert rule(3) > receiver.version  # not allowed yet; pushed anyway, the views change under us
    sender.push(_state(3), version=3)
    assert _snapshot({k: p.data for k, p in params.items()}) == _snapshot(_state(3))
    assert TransportConfig(mode="copy").must_have_applied(3) == 1
    assert TransportConfig(type="tcp").must_have_applied(3) == -1


def test_catch_up_copies_the_newest_slot_and_leaves_newer_targets_alone(name: str, sender: ShmSender) -> None:
    from loong_transfermesh import TransportConfig, catch_up

    config = TransportConfig(name=name, mode="zero_copy", timeout_s=5)
    targets = _zeros_like(_state(0))
    assert catch_up(config, targets, held=0) == 0  # nothing pushed yet
    sender.push(_state(1), version=1)
    sender.push(_state(2), version=2)
    before = {k: v.data_ptr() for k, v in targets.items()}
    assert catch_up(config, targets, held=0) == 2
    assert _snapshot(targets) == _snapshot(_state(2))
    assert {k: v.data_ptr() for k, v in targets.items()} == before  # copied, not viewed
    sender.push(_state(3), version=3)
    assert catch_up(config, targets, held=5) == 5 and _snapshot(targets) == _snapshot(_state(2))
    assert catch_up(TransportConfig(type="tcp"), targets, held=1) == 1  # a stream keeps nothing
