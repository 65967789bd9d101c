"""loong-teacher's ``sglang`` backend against the embedded engine's SGLang-compatible server over
real loopback HTTP.

References: the served model's own forward pass (float64 log-softmax) and loong-teacher's ``local``
backend loading the same checkpoint directory through transformers (a second implementation).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest
import torch
import uvicorn
from train_testkit import tiny_config

from loong_core.net import free_port
from loong_teacher import (
    LocalTeacherConfig,
    ScoreRequest,
    SGLangTeacher,
    SGLangTeacherConfig,
    TeacherManager,
    TeacherManagerConfig,
    TeacherServerError,
)
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.engines.embedded.http_app import build_app
from loong_train.models.decoder import CausalLM

CFG = tiny_config()


@contextlib.contextmanager
def _serve(app, port: int = 0, delay_s: float = 0.0):
    """``app`` on a uvicorn server in a thread (started after ``delay_s``); yields its base url."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), server.run()), daemon=True)
    thread.start()
    if not delay_s:
        while not server.started:
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _samples(n: int, seed: int = 0) -> list[ScoreRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length, prompt = rng.randrange(6, 14), rng.randrange(2, 5)
        ids = [rng.randrange(CFG.vocab_size) for _ in range(length)]
        tags = {"domain": "remote" if i % 2 else "local"}
        out.append(ScoreRequest(token_ids=ids, loss_mask=[0] * prompt + [1] * (length - prompt), tags=tags))
    return out


def _forward(model_dir, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, float64 ([len(ids) - 1])."""
    model = CausalLM.from_pretrained(model_dir).double().eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).double()[0, :-1], -1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def _engine(model_dir) -> EmbeddedEngine:
    return EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=0)


def test_remote_scores_equal_forward_pass_and_local_backend(model_dir):
    samples = _samples(7)
    with _serve(build_app(_engine(model_dir))) as url:
        remote = SGLangTeacherConfig(name="remote", url=url, tags=["remote"], batch_size=2)
        config = TeacherManagerConfig(
            teachers=[remote, LocalTeacherConfig(name="local", path=str(model_dir), tags=["local"])]
        )
        manager = TeacherManager(config)
        scores = manager.score(samples)
        by_local = TeacherManager(TeacherManagerConfig(teachers=[config.teachers[1]], default="local")).score(
            samples
        )
        requests = manager.teachers["remote"].requests
        manager.close()
    assert scores.teacher == ["local", "remote"] * 3 + ["local"]
    assert requests == 2  # 3 remote rows in batches of 2
    for b, s in enumerate(samples):
        pos = torch.tensor([t for t, m in enumerate(s.loss_mask) if m])
        want = _forward(model_dir, s.token_ids)[pos - 1]
        torch.testing.assert_close(scores.logprobs[b, pos].double(), want, rtol=0, atol=2e-5)
        torch.testing.assert_close(scores.logprobs[b], by_local.logprobs[b], rtol=0, atol=2e-5)


def test_connection_refused_is_retried_until_the_server_is_up(model_dir):
    port = free_port()
    samples = _samples(2)
    config = SGLangTeacherConfig(name="remote", url=f"http://127.0.0.1:{port}", retries=6, backoff_s=0.1)
    teacher = SGLangTeacher(config)
    rows = [(s.token_ids, [t for t, m in enumerate(s.loss_mask) if m]) for s in samples]
    with _serve(build_app(_engine(model_dir)), port=port, delay_s=0.3):
        scores = teacher.score(rows)
    assert teacher.retried >= 1
    want = _forward(model_dir, samples[0].token_ids)[torch.tensor(rows[0][1]) - 1]
    torch.testing.assert_close(scores[0].logprobs.double(), want, rtol=0, atol=2e-5)


class _SlowFirst:
    """ASGI wrapper: the first ``/generate`` stalls past the client's timeout, later ones pass."""

    def __init__(self, app, stall_s: float) -> None:
        self.app, self.stall_s, self.stalled = app, stall_s, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/generate" and not self.stalled:
            self.stalled += 1
            await asyncio.sleep(self.stall_s)
        await self.app(scope, receive, send)


def test_timeouts_are_retried_and_then_reported(model_dir):
    samples = _samples(1)
    rows = [(s.token_ids, [t for t, m in enumerate(s.loss_mask) if m]) for s in samples]
    slow = _SlowFirst(build_app(_engine(model_dir)), stall_s=2.0)
    with _serve(slow) as url:
        teacher = SGLangTeacher(SGLangTeacherConfig(name="r", url=url, timeout_s=0.5, backoff_s=0.05))
        scores = teacher.score(rows)
        assert teacher.retried == 1 and slow.stalled == 1 and len(scores[0].logprobs) == len(rows[0][1])
        slow.stalled = 0
        slow.stall_s = 5.0
        impatient = SGLangTeacher(SGLangTeacherConfig(name="r", url=url, timeout_s=0.3, retries=0))
        with pytest.raises(TeacherServerError, match="failed after 1 tries: ReadTimeout"):
            impatient.score(rows)


def test_bad_request_is_an_error_naming_the_server(model_dir):
    with _serve(build_app(_engine(model_dir))) as url:
        teacher = SGLangTeacher(SGLangTeacherConfig(name="r", url=url))
        with pytest.raises(TeacherServerError, match="HTTP 400"):
            teacher.score([([1, 2, CFG.vocab_size + 5], [1, 2])])


def test_remote_topk_equals_forward_pass(model_dir):
    samples = _samples(3)
    with _serve(build_app(_engine(model_dir))) as url:
        config = TeacherManagerConfig(
            teachers=[SGLangTeacherConfig(name="remote", url=url)], default="remote", top_k=4
        )
        scores = TeacherManager(config).score(samples)
    for b, s in enumerate(samples):
        pos = torch.tensor([t for t, m in enumerate(s.loss_mask) if m])
        model = CausalLM.from_pretrained(model_dir).double().eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([s.token_ids])).double()[0], -1)[pos - 1]
        top_lp, top_ids = logp.topk(4, dim=-1)
        assert torch.equal(scores.topk_ids[b, pos], top_ids)
        torch.testing.assert_close(scores.topk_logprobs[b, pos].double(), top_lp, rtol=0, atol=2e-5)
        tail = torch.log1p(-top_lp.exp().sum(-1))
        torch.testing.assert_close(scores.tail_logprobs[b, pos].double(), tail, rtol=0, atol=1e-4)
