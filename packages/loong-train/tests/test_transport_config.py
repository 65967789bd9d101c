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
        ("transport.type='tcp'", "loong-train drives 'shm'"),
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
