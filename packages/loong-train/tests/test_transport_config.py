"""The ``[transport]`` recipe table: defaults, the modes loong-train drives, errors naming the key."""

import pytest

from loong_core.config import ConfigError
from loong_train.config import load_recipe
from loong_transfermesh import TransportConfig


def test_shipped_recipe_uses_shared_memory_by_default():
    assert load_recipe("tiny-calc-agent").transport == TransportConfig()


def test_zero_copy_and_bucket_size_are_settable():
    t = load_recipe("tiny-calc-agent", ["transport.mode='zero_copy'", "transport.bucket_mb=8"]).transport
    assert (t.type, t.mode, t.bucket_bytes) == ("shm", "zero_copy", 8 << 20)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "transport.type='nccl'",
            "loong-train drives type 'shm' (trainer and engines on one host) and 'tcp'",
        ),
        ("transport.delta=true", "delta works with type 'tcp', not 'shm'"),
        ("transport.type='carrier-pigeon'", "'transport.type': invalid value 'carrier-pigeon'"),
        ("transport.mode='mirror'", "'transport.mode': invalid value 'mirror'"),
        ("transport.bucket_mb='big'", "'transport.bucket_mb': expected float, got str"),
        ("transport.buckets=3", "unknown config key 'transport.buckets'"),
        ("transport.bucket_mb=0", "bucket_mb must be > 0"),
    ],
)
def test_bad_transport_settings_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe("tiny-calc-agent", [override])
    assert message in str(err.value)


def test_tcp_is_driven_and_its_port_is_chosen_before_the_sender_binds():
    t = load_recipe("tiny-calc-agent", ["transport.type='tcp'"]).transport
    assert t.address == "127.0.0.1:0"
    chosen = t.with_free_port()
    host, _, port = chosen.address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert chosen.with_free_port() == chosen
    with pytest.raises(ConfigError, match="without delta"):
        load_recipe("tiny-calc-agent", ["transport.type='tcp'", "transport.delta=true"])
