"""Idle cores lent to the trainer (:mod:`loong_train.cores`): the board between processes, the
borrower's thread counts in forward and backward, and when an engine and its worker lend."""

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from typing import ClassVar

import pytest
import torch
from train_testkit import tiny_family_model, tiny_qwen3

from loong_core.config import ConfigError
from loong_core.protocols import SamplingParams
from loong_core.records import TrainBatch
from loong_train.backends import packing
from loong_train.config import load_recipe
from loong_train.controller import trainer_options
from loong_train.cores import Borrower, CoreBoard, Lender
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.source import GroupSource
from loong_train.tiny import calc
from loong_train.workers.rollout import RolloutWorker
from loong_train.workers.trainer import TrainerWorker
from loong_transfermesh import TransportConfig


@pytest.fixture
def board():
    """A run's board, as a reader beside the lenders and borrowers under test sees it."""
    board = CoreBoard(f"test-{uuid.uuid4().hex[:8]}")
    yield board
    board.close(unlink=True)


@pytest.fixture
def threads():
    """Restores this process's torch threads after a test that changes them."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_board_is_shared_between_processes_and_lends_nothing_until_written(board):
    assert board.lent() == 0  # a fresh board: no worker has said it rests
    lend = f"from loong_train.cores import CoreBoard; CoreBoard({board.name!r}).lend(1, 3)"
    subprocess.run([sys.executable, "-c", lend], check=True)
    assert board.lent() == 3
    board.lend(0, 1)
    assert board.lent() == 4
    board.reclaim(1)
    assert board.lent() == 1


def test_a_lender_lends_while_no_work_is_open_and_waits_for_its_threads_back(board):
    lender = Lender(board.name, slot=0, threads=1, wait_s=30)
    assert board.lent() == 1
    assert lender.begin() and not lender.begin()  # two spells overlap: one takes the threads back
    lender.end()
    assert board.lent() == 0
    lender.end()
    assert board.lent() == 1
    board.borrowed = 1  # the trainer runs on the lent thread
    events = []

    def give_back():
        time.sleep(0.05)
        events.append("given back")
        board.borrowed = 0

    trainer = threading.Thread(target=give_back)
    trainer.start()
    with lender.working():
        events.append("working")
    trainer.join()
    assert events == ["given back", "working"] and board.lent() == 1
    board.borrowed = 1  # a trainer that never gives them back (stuck, gone): the wait ends
    lender.wait_s = 0.01
    with lender.working():
        pass
    lender.close()
    assert board.lent() == 0


class _Seen(torch.autograd.Function):
    """The identity, noting torch's thread count when its forward and its backward run."""

    seen: ClassVar[list[tuple[str, int]]] = []

    @staticmethod
    def forward(ctx, x):
        _Seen.seen.append(("forward", torch.get_num_threads()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Seen.seen.append(("backward", torch.get_num_threads()))
        return grad


class _Probe(torch.nn.Linear):
    def forward(self, x):
        return _Seen.apply(super().forward(x))


def test_the_borrower_takes_lent_threads_before_each_linear_layer_and_optimizer_step(board, threads):
    torch.set_num_threads(1)
    model = torch.nn.Sequential(_Probe(4, 4), torch.nn.Tanh(), _Probe(4, 1))
    reference = _Probe(4, 1)  # a KL reference: another model the step runs
    borrower = Borrower(board.name, own=1)
    _Seen.seen.clear()
    with borrower.hooks(model, reference):
        board.lend(0, 1)  # the engine rests while the forward runs
        out = model(torch.randn(3, 4)).sum()
        board.reclaim(0)  # and works again before the backward
        out.backward()
        board.lend(0, 1)  # and rests again before the optimizer step
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.register_step_pre_hook(lambda *_: _Seen.seen.append(("step", torch.get_num_threads())))
        optimizer.step()
        board.reclaim(0)  # and works again before the reference's forward
        with torch.no_grad():
            reference(torch.randn(3, 4))
    assert _Seen.seen == [
        *[("forward", 2)] * 2,
        *[("backward", 1)] * 2,
        ("step", 2),
        ("forward", 1),
    ]
    assert torch.get_num_threads() == 1 and board.borrowed == 0  # the lent threads given back
    assert 1 < borrower.threads_mean < 2
    _Seen.seen.clear()
    board.lend(0, 1)
    model(torch.randn(3, 4)).sum().backward()  # outside the hooks: own threads only
    assert {n for _, n in _Seen.seen} == {1}


def test_the_lm_head_chunks_take_the_threads_lent_when_they_run(board, threads, monkeypatch):
    """The packed step's head runs no linear layer of its own (its chunks multiply by the
    weight): each chunk adjusts, forward and backward."""
    torch.set_num_threads(1)
    model = tiny_qwen3(0)
    (micro,) = packing.micro_batches(list(range(1, 13)), [6, 6], 0)
    seen, logits = [], packing._logits
    monkeypatch.setattr(packing, "_logits", lambda *a: seen.append(torch.get_num_threads()) or logits(*a))
    with Borrower(board.name, own=1).hooks(model):
        board.lend(0, 1)
        hidden = model.packed_hidden(micro.ids, micro.layout)  # its linear layers take 2 threads
        board.reclaim(0)  # the engine works again before the head runs
        lp, _ = packing.logprobs(model, micro, 1.0, False, hidden=hidden)
        board.lend(0, 1)  # and rests again before the backward
        lp.sum().backward()
        board.reclaim(0)  # and works again before a scoring pass (no gradient: another path)
        with torch.no_grad():
            packing.logprobs(model, micro, 1.0, None, hidden=hidden.detach())
    assert seen == [1, 2, 1]


def test_a_trainer_adjusts_before_its_kl_reference_runs(tiny_dir, board, threads):
    """A KL reference is a second model a train step runs: its linear layers take the threads
    lent when they run, as the policy's do."""
    recipe = load_recipe("tiny-calc-agent", ["loss.kl_coef=0.1", "train.threads=1"])
    name = f"cores-{board.name}"
    trainer = TrainerWorker(
        str(tiny_dir), transport=TransportConfig(name=name), cores=board.name, **trainer_options(recipe)
    )
    try:
        down = trainer.backend.reference.model.layers[0].mlp.down_proj
        seen = []
        down.register_forward_pre_hook(lambda *_: board.reclaim(0))  # the engine works again meanwhile
        down.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        board.lend(0, 1)
        rows = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12]]
        flat = [t for row in rows for t in row]
        mask = [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
        trainer.train_step(
            TrainBatch(
                token_ids=flat,
                loss_mask=mask,
                advantages=[0.5 * m for m in mask],
                behaviour_logprobs=[-3.0 * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                row_lens=[len(r) for r in rows],
                sample_ids=["0", "1"],
                policy_version=0,
            )
        )
        assert seen == [1]
    finally:
        trainer.close()


def test_the_engine_takes_its_threads_back_once_a_spell_of_work_not_each_decode_step(board):
    engine = EmbeddedEngine(tiny_family_model("qwen3", 0, vocab_size=40), seed=0)
    lender = Lender(board.name, slot=0, threads=1)
    calls = []
    begin, end = lender.begin, lender.end
    lender.begin = lambda: calls.append(("begin", board.lent())) or begin()
    lender.end = lambda: end() or calls.append(("end", board.lent()))
    engine.lend_idle_cores(lender)

    async def spell():
        return await asyncio.gather(
            *(engine.generate([1, i], SamplingParams(max_new_tokens=4 + i)) for i in range(3))
        )

    asyncio.run(spell())
    # the spell and each run of decode steps within it open work; only the spell took the
    # thread back, and the engine lent it again at the spell's end, not before
    assert engine.stats.steps >= 6 and len(calls) >= 4
    assert [n for what, n in calls if what == "begin"] == [1] + [0] * (len(calls) // 2 - 1)
    assert [n for what, n in calls if what == "end"] == [0] * (len(calls) // 2 - 1) + [1]
    asyncio.run(engine.score([1, 2, 3]))
    assert calls[-2:] == [("begin", 1), ("end", 1)]  # a scoring pass: a spell of its own


def test_a_rollout_worker_lends_its_threads_while_its_engine_rests(tiny_dir, board):
    worker = RolloutWorker(
        str(tiny_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": 8},
        limits={"max_turns": 1, "max_model_tokens": 40},
        threads=1,
        worker_id=1,
        cores=board.name,
    )
    try:
        assert board.lent() == 1  # up and resting
        during = []
        begin = worker.lender.begin

        def noting():
            reclaimed = begin()
            during.append((reclaimed, board.lent()))
            return reclaimed

        worker.lender.begin = noting
        source = GroupSource(calc.train_tasks(0, []), group_size=2)
        worker.rollout(source.specs(source.next_group()))
        assert during[0] == (True, 0) and board.lent() == 1
    finally:
        worker.close()
    assert board.lent() == 0  # a closed worker lends nothing
    # and leaves no board behind (on a node without the trainer nothing else would remove it)
    assert not board.path.exists()


def test_borrowing_is_refused_for_a_trainer_of_other_processes():
    """The torch backend's one process borrows (an SGLang engine lends nothing:
    ``test_recipe_config.py``'s rule cases)."""
    with pytest.raises(ConfigError, match=r"train\.borrow_idle_threads = true lends threads to the torch"):
        load_recipe("tiny-calc-agent", ["train.borrow_idle_threads=true", "train.backend.type=megatron"])
