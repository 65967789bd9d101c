"""``free_port``: a port the OS reports free on the given host, which a new socket can then bind."""

import socket

import pytest

from loong_core.net import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_free_port_can_be_bound_and_listened_on(host):
    port = free_port(host)
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind((host, port))
        s.listen()
        assert s.getsockname()[1] == port


def test_the_default_host_is_loopback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_a_host_that_is_not_this_machines_is_an_error():
    with pytest.raises(OSError):
        free_port("192.0.2.1")  # TEST-NET-1: documentation only, never a local address
