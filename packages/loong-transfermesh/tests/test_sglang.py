"""SGLang adapter pieces that need no server: bucket plan, flattened-bucket layout, config.

The end-to-end push into a live server, Loong's embedded SGLang-compatible one (group join,
broadcast, pause/continue, version read-back) is tested in loong-train's
tests/test_sglang_server.py, the only package allowed to import both sides.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import pytest
import torch

from loong_core.net import free_port
from loong_transfermesh.sglang import (
    SGLangPusherConfig,
    bucket_dtype,
    flatten_bucket,
    plan_buckets,
    unflatten_bucket,
)

torch.set_num_threads(1)


def test_plan_keeps_one_dtype_per_bucket_and_the_byte_cap():
    named = {
        "a": torch.zeros(10),  # 40 B
        "b": torch.zeros(4, dtype=torch.bfloat16),  # 8 B
        "c": torch.zeros(20),  # 80 B: a + c > 100
        "d": torch.zeros(50),  # 200 B: alone, larger than a bucket
        "e": torch.zeros(2, dtype=torch.bfloat16),
    }
    assert plan_buckets(named, 100) == [["a"], ["c"], ["d"], ["b", "e"]]
    assert plan_buckets(named, 10**6) == [["a", "c", "d"], ["b", "e"]]


def test_flattened_bucket_is_the_contiguous_concatenation_and_round_trips_bit_exactly():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(3, 4, generator=gen),
        "b": torch.randn(4, generator=gen),
        "s": torch.tensor(2.5),
    }
    flat = flatten_bucket(list(tensors.values()))
    assert flat.shape == (17,) and torch.equal(flat[:12], tensors["w"].reshape(-1))
    assert torch.equal(flat[12:16], tensors["b"]) and flat[16] == 2.5  # no padding between tensors
    back = unflatten_bucket(
        flat, list(tensors), [t.dtype for t in tensors.values()], [list(t.shape) for t in tensors.values()]
    )
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert bucket_dtype([torch.bfloat16, torch.float32]) == torch.float32


def test_config_names_the_bad_value():
    with pytest.raises(ValueError, match="backend"):
        SGLangPusherConfig(urls=["http://x"], backend="mpi")
    with pytest.raises(ValueError, match="pause_mode"):
        SGLangPusherConfig(urls=["http://x"], pause_mode="soon")
    with pytest.raises(ValueError, match="urls"):
        SGLangPusherConfig(urls=[])


@contextlib.contextmanager
def _reporting(label: str):
    """A loopback HTTP server that answers ``GET /get_weight_version`` with ``label``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"weight_version": label}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_behind_names_servers_answering_another_version_and_skips_silent_ones():
    """SGLang's ``"default"`` (no update since launch) counts as ``initial_version``; a server
    that does not answer is left for later (not pushed, so no rendezvous waits on it)."""
    from loong_transfermesh import SGLangServers

    silent = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with _reporting("default") as fresh, _reporting("3") as at_3:
        servers = SGLangServers(
            SGLangPusherConfig(urls=[fresh, at_3, silent], timeout_s=5), initial_version=3
        )
        try:
            assert servers.behind(3) == []
            assert servers.behind(4) == [fresh, at_3]
            servers.initial_version = 0  # launched from version 0: "default" is behind 3
            assert servers.behind(3) == [fresh]
        finally:
            servers.close()
