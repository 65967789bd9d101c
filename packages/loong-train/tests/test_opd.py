"""On-policy distillation in the trainer: its OPD advantages and dense (forward KL, generalized JSD)
objectives against float64 references, and the teachers it refuses."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from loong_core.records import TrainBatch
from loong_teacher import LocalTeacherConfig, TeacherManagerConfig, TokenizerMismatch
from loong_train.algo.config import OPDConfig
from loong_train.config import load_recipe
from loong_train.controller import trainer_options
from loong_train.messages import StepResult
from loong_train.models.decoder import CausalLM, DecoderConfig
from loong_train.models.tokenizer import load_tokenizer
from loong_train.tiny.tokenizer import build_tokenizer
from loong_train.workers.trainer import TrainerWorker
from loong_transfermesh import TransportConfig

TEACHERS = {"add-teacher": (1, 1.0), "mul-teacher": (2, 0.5)}  # name: (init seed, coefficient)


def _checkpoint(path, seed: int):
    """A small random Qwen3 (logits far from uniform) beside the char tokenizer."""
    build_tokenizer(path)
    cfg = DecoderConfig(
        vocab_size=len(load_tokenizer(path)),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = CausalLM(cfg)
    model.init_weights(seed, std=0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd")
    out = {"student": _checkpoint(root / "student", 0)}
    for name, (seed, _) in TEACHERS.items():
        out[name] = _checkpoint(root / name, seed)
    return out


def _opd(dirs, mode: str, task_coef: float = 1.0) -> OPDConfig:
    teachers = [
        LocalTeacherConfig(name=n, path=str(dirs[n]), tags=[n.split("-")[0]], coefficient=c)
        for n, (_, c) in TEACHERS.items()
    ]
    manager = TeacherManagerConfig(teachers=teachers, default="add-teacher", budget_bytes=10**6)
    return OPDConfig(enabled=True, mode=mode, task_coef=task_coef, teachers=manager)


def _batch(vocab: int) -> TrainBatch:
    """Three rows: domain add, domain mul, and an untagged row (the default teacher's)."""
    gen = torch.Generator().manual_seed(3)
    lens = [9, 7, 6]
    masks = [[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    task_adv = [0.8, -1.2, 0.3]
    mask = [m for row in masks for m in row]
    behaviour = (-torch.rand(sum(lens), generator=gen) * 4).tolist()
    return TrainBatch(
        token_ids=torch.randint(1, vocab, (sum(lens),), generator=gen).tolist(),
        loss_mask=mask,
        advantages=[a * m for a, row in zip(task_adv, masks, strict=True) for m in row],
        behaviour_logprobs=[b * m for b, m in zip(behaviour, mask, strict=True)],
        versions=[0 if m else -1 for m in mask],
        row_lens=lens,
        sample_ids=["a", "b", "c"],
        policy_version=0,
        row_tags=[{"domain": "add"}, {"domain": "mul"}, {}],
    )


def _reference(dirs, batch: TrainBatch, mode: str, task_coef: float) -> tuple[list[float], dict]:
    """A_t = [alpha A_task_t] - lambda_T (b_t - log pi_T(y_t)), teachers run in float64, plain loops."""
    route = {"add": "add-teacher", "mul": "mul-teacher"}
    models = {n: CausalLM.from_pretrained(dirs[n]).double().eval() for n in TEACHERS}
    out, gaps = [], {n: [] for n in TEACHERS}
    for (s, e), tags in zip(batch.rows(), batch.row_tags, strict=True):
        name = route.get(tags.get("domain", ""), "add-teacher")
        ids = torch.tensor([batch.token_ids[s:e]])
        with torch.no_grad():
            logp = torch.log_softmax(models[name](ids)[0].double(), dim=-1)
        for t in range(e - s):
            if not batch.loss_mask[s + t]:
                out.append(0.0)
                continue
            gap = batch.behaviour_logprobs[s + t] - float(logp[t - 1, ids[0, t]])
            gaps[name].append(gap)
            task = task_coef * batch.advantages[s + t] if mode == "mixed" else 0.0
            out.append(task - TEACHERS[name][1] * gap)
    return out, {n: sum(g) / len(g) for n, g in gaps.items()}


def _trainer(dirs, opd: OPDConfig, name: str) -> TrainerWorker:
    recipe = msgspec.structs.replace(load_recipe("tiny-calc-agent"), opd=opd)
    return TrainerWorker(
        str(dirs["student"]), transport=TransportConfig(name=name), **trainer_options(recipe)
    )


def _one_step(dirs, opd: OPDConfig, name: str) -> tuple[TrainBatch, list[TrainBatch], StepResult]:
    """One trainer step on :func:`_batch`: the batch, what the backend trained on, the step."""
    trainer = _trainer(dirs, opd, name)
    seen = []
    step = trainer.backend.train_step
    trainer.backend.train_step = lambda b: (seen.append(b), step(b))[1]
    try:
        batch = _batch(len(load_tokenizer(dirs["student"])))
        metrics = trainer.train_step(batch)
    finally:
        trainer.close()
    return batch, seen, metrics


@pytest.mark.parametrize(("mode", "task_coef"), [("teacher_only", 1.0), ("mixed", 0.5)])
def test_trainer_opd_advantages_match_a_float64_reference(dirs, mode, task_coef):
    batch, seen, step = _one_step(dirs, _opd(dirs, mode, task_coef), f"opd-test-{mode}")
    metrics = step.metrics
    want, kl = _reference(dirs, batch, mode, task_coef)
    assert seen[0].advantages == pytest.approx(want, abs=2e-5)
    assert seen[0].behaviour_logprobs == batch.behaviour_logprobs
    assert metrics["opd/add-teacher/samples"] == 2.0  # the untagged row goes to the default
    assert metrics["opd/mul-teacher/samples"] == 1.0
    for name in TEACHERS:
        assert metrics[f"opd/{name}/kl"] == pytest.approx(kl[name], abs=2e-5)
    assert metrics["teacher/loads"] >= 1 and metrics["teacher/resident_bytes"] <= 10**6
    assert step.start <= step.teacher_end <= step.end
    assert "clip_frac" in metrics


def _divergence(p: list[float], q: list[float], beta: float) -> float:
    """GKD's generalized JSD of teacher ``p`` and student ``q`` (beta 0: KL(p || q), 1: KL(q || p))."""

    def kl(a: list[float], b: list[float]) -> float:
        return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))

    if beta in (0.0, 1.0):
        return kl(p, q) if beta == 0 else kl(q, p)
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q, strict=True)]
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def _topk_reference(dirs, batch: TrainBatch, k: int, mode: str, task_coef: float, beta: float = 0.0) -> dict:
    """Plain float64 loops: each loss token's routed teacher top-k (ids, logprobs), coefficient and
    advantage, and L_distill = token-mean of lambda * D(T, S) over the k ids plus the tail (D the
    generalized JSD of ``beta``, 0 the forward KL), with S the student before the step; ``kl`` the
    forward KL's token mean, ``div`` D's."""
    route = {"add": "add-teacher", "mul": "mul-teacher"}
    teachers = {n: CausalLM.from_pretrained(dirs[n]).double().eval() for n in TEACHERS}
    student = CausalLM.from_pretrained(dirs["student"]).double().eval()
    out = {"ids": [], "logprobs": [], "coef": [], "adv": [], "loss": 0.0, "kl": 0.0, "div": 0.0}
    tokens = 0
    for (s, e), tags in zip(batch.rows(), batch.row_tags, strict=True):
        name = route.get(tags.get("domain", ""), "add-teacher")
        ids = torch.tensor([batch.token_ids[s:e]])
        with torch.no_grad():
            t_logp = torch.log_softmax(teachers[name](ids)[0].double(), dim=-1)
            s_logp = torch.log_softmax(student(ids)[0].double(), dim=-1)
        for t in range(e - s):
            if not batch.loss_mask[s + t]:
                out["ids"] += [0] * k
                out["logprobs"] += [0.0] * k
                out["coef"].append(0.0)
                out["adv"].append(0.0)
                continue
            top = sorted(range(t_logp.shape[1]), key=lambda v: -float(t_logp[t - 1, v]))[:k]
            out["ids"] += top
            out["logprobs"] += [float(t_logp[t - 1, v]) for v in top]
            lam = TEACHERS[name][1]
            out["coef"].append(lam)
            out["adv"].append(task_coef * batch.advantages[s + t] if mode == "mixed" else 0.0)
            p_top = [math.exp(float(t_logp[t - 1, v])) for v in top]
            q_top = [math.exp(float(s_logp[t - 1, v])) for v in top]
            p_all, q_all = [*p_top, 1.0 - sum(p_top)], [*q_top, 1.0 - sum(q_top)]
            div = _divergence(p_all, q_all, beta)
            out["loss"] += lam * div
            out["kl"] += _divergence(p_all, q_all, 0.0)
            out["div"] += div
            tokens += 1
    for key in ("loss", "kl", "div"):
        out[key] /= tokens
    return out


@pytest.mark.parametrize(("mode", "task_coef"), [("teacher_only", 1.0), ("mixed", 0.5)])
def test_forward_kl_distillation_matches_a_float64_reference(dirs, mode, task_coef):
    """objective = "forward_kl": the batch the backend trains on carries each loss token's teacher
    top-k and coefficient, the advantages are the task's (mixed) or 0, and the step's loss (the
    policy loss is 0 where advantages are 0) and ``distill_kl`` equal the float64 reference."""
    k = 4
    opd = _opd(dirs, mode, task_coef)
    opd = msgspec.structs.replace(
        opd, objective="forward_kl", teachers=msgspec.structs.replace(opd.teachers, top_k=k)
    )
    batch, seen, step = _one_step(dirs, opd, f"opd-test-fkl-{mode}")
    metrics = step.metrics
    want = _topk_reference(dirs, batch, k, mode, task_coef)
    (got,) = seen
    got.validate()
    assert got.teacher_top_k == k and got.teacher_topk_ids == want["ids"]
    assert got.teacher_topk_logprobs == pytest.approx(want["logprobs"], abs=2e-5)
    assert got.distill_coef == want["coef"] and got.advantages == pytest.approx(want["adv"], abs=1e-6)
    assert metrics["distill_kl"] == pytest.approx(want["kl"], rel=1e-4)
    if mode == "teacher_only":
        assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-4)
    else:  # the PPO term on the first step (ratio 1 up to the train-inference gap) plus L_distill
        assert metrics["loss"] == pytest.approx(want["loss"] + metrics["pg_loss"], rel=1e-4)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["opd/add-teacher/samples"] == 2.0


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_jsd_distillation_matches_a_float64_reference(dirs, beta):
    """objective = "jsd": the batch carries the teachers' top-k and jsd_beta, and the step's loss is
    the float64 generalized JSD (beta 1: the reverse KL(S || T)) over the top-k + tail; the logged
    ``distill_kl`` stays the forward KL, so runs with either objective compare."""
    k = 4
    opd = _opd(dirs, "teacher_only")
    opd = msgspec.structs.replace(
        opd, objective="jsd", jsd_beta=beta, teachers=msgspec.structs.replace(opd.teachers, top_k=k)
    )
    batch, seen, step = _one_step(dirs, opd, f"opd-test-jsd-{beta}")
    metrics = step.metrics
    want = _topk_reference(dirs, batch, k, "teacher_only", 1.0, beta)
    (got,) = seen
    got.validate()
    assert got.distill_beta == beta and got.teacher_topk_ids == want["ids"]
    assert want["div"] != pytest.approx(want["kl"], rel=1e-2)  # the two divergences differ here
    assert metrics["distill_jsd"] == pytest.approx(want["div"], rel=1e-4)
    assert metrics["distill_kl"] == pytest.approx(want["kl"], rel=1e-4)
    assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0


def test_a_teacher_id_outside_the_students_vocabulary_is_a_clear_error(dirs):
    from loong_train.backends.torch_backend import TorchBackend

    backend = TorchBackend.from_pretrained(dirs["student"], lr=1e-3)
    vocab = backend.model.config.vocab_size
    batch = _batch(len(load_tokenizer(dirs["student"])))
    n = batch.num_tokens
    bad = msgspec.structs.replace(
        batch,
        teacher_topk_ids=[1] * (n - 1) + [vocab],
        teacher_topk_logprobs=[-0.5] * n,
        distill_coef=[1.0] * n,
    )
    with pytest.raises(
        ValueError, match=rf"holds id {vocab}, outside the student's vocabulary \[0, {vocab}\)"
    ):
        backend.train_step(bad)


def test_forward_kl_needs_the_teachers_top_k(dirs):
    with pytest.raises(ValueError, match=r"needs \[opd.teachers\] top_k > 0"):
        msgspec.structs.replace(_opd(dirs, "teacher_only"), objective="forward_kl").__post_init__()


def test_distiller_refuses_a_teacher_with_another_chat_template(dirs, tmp_path):
    other = _checkpoint(tmp_path / "other", 5)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("assistant\\n", "assistant:\\n")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    teachers = [LocalTeacherConfig(name="odd", path=str(other), tags=["add"])]
    cfg = OPDConfig(enabled=True, teachers=TeacherManagerConfig(teachers=teachers, default="odd"))
    with pytest.raises(TokenizerMismatch, match="template"):
        _trainer(dirs, cfg, "opd-test-mismatch")
