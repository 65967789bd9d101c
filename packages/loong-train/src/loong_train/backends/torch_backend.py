"""The torch train backend: recompute logprobs, take PPO/GRPO steps, export HF-named weights.

The loss is :func:`loong_train.algo.losses.policy_loss` under a :class:`LossConfig`. Two of its
options need extra no-grad forwards before the update: decoupled PPO recomputes the proximal
logprobs with the current weights, and a KL penalty scores the batch with a frozen copy of the
initial model (the reference policy, kept only when ``kl_coef > 0``). A batch carrying teacher
top-k targets (on-policy distillation, ``objective = "forward_kl"``) adds
:func:`~loong_train.algo.losses.distill_loss` on the same forward's logits.

Rows of a TrainBatch are right-padded into [rows, max_len]; with causal attention a real token
never sees a later pad, so no attention mask is needed. The logprob of token j comes from the
logits at position j - 1, divided by the sampling temperature exactly as the engine did.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from loong_core.records import TrainBatch
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import aggregate, distill_loss, policy_loss
from loong_train.backends.metrics import mismatch_stats
from loong_train.models.auto import load_causal_lm
from loong_train.models.decoder import CausalLM

__all__ = ["TorchBackend", "logprobs_and_entropy", "token_logprobs"]


def token_logprobs(model: CausalLM, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logprob of each token given its prefix: [rows, seq] -> [rows, seq] (column 0 is 0)."""
    return logprobs_and_entropy(model, ids, temperature, None)[0]


def logprobs_and_entropy(
    model: CausalLM, ids: torch.Tensor, temperature: float, entropy_grad: bool | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` and, unless ``entropy_grad`` is None, each position's entropy
    H_t = -sum_v p(v) log p(v) of the sampling distribution (with a gradient when ``entropy_grad``)."""
    return _from_logits(model(ids)[:, :-1].float(), ids, temperature, entropy_grad)


def _from_logits(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, entropy_grad: bool | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_and_entropy` from the float32 logits that predict tokens 1.. of ``ids``."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    if entropy_grad is None:
        return lp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        h = -(logp.exp() * logp).sum(-1)
    return lp, torch.cat([torch.zeros_like(h[:, :1]), h], dim=1)


def _pad(values: list, lens: list[int], fill, dtype) -> torch.Tensor:
    out = torch.full((len(lens), max(lens)), fill, dtype=dtype)
    start = 0
    for i, n in enumerate(lens):
        out[i, :n] = torch.tensor(values[start : start + n], dtype=dtype)
        start += n
    return out


class TorchBackend:
    """AdamW with linear warmup, gradient clipping, one optimizer step per batch."""

    def __init__(
        self,
        model: CausalLM,
        *,
        lr: float,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        loss: LossConfig | None = None,
        temperature: float = 1.0,
    ) -> None:
        self.model = model.train()
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps))
        )
        self.grad_clip, self.temperature = grad_clip, temperature
        self.loss_cfg = loss or LossConfig()
        self.reference = _frozen_copy(model) if self.loss_cfg.kl_coef > 0 else None
        self.steps = 0
        self.trust_remote_code = False

    @classmethod
    def from_pretrained(
        cls, path: str | Path, trust_remote_code: bool = False, **kwargs: Any
    ) -> TorchBackend:
        """The checkpoint at ``path`` on the implementation :func:`load_causal_lm` picks."""
        backend = cls(load_causal_lm(path, trust_remote_code), **kwargs)
        backend.trust_remote_code = trust_remote_code
        return backend

    def tensors(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        lens = batch.row_lens
        return {
            "ids": _pad(batch.token_ids, lens, 0, torch.long),
            "mask": _pad(batch.loss_mask, lens, 0, torch.float32),
            "adv": _pad(batch.advantages, lens, 0.0, torch.float32),
            "behaviour": _pad(batch.behaviour_logprobs, lens, 0.0, torch.float32),
            "versions": _pad(batch.versions, lens, -1, torch.long),
        }

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return token_logprobs(self.model, self.tensors(batch)["ids"], self.temperature)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns loss and train-inference mismatch stats."""
        t = self.tensors(batch)
        extra = self._no_grad_logprobs(t["ids"])
        bonus = self.loss_cfg.entropy_coef
        logits = self.model(t["ids"])[:, :-1].float()
        lp, entropy = _from_logits(logits, t["ids"], self.temperature, bonus > 0)
        loss, stats = policy_loss(lp, t["behaviour"], t["adv"], t["mask"], self.loss_cfg, **extra)
        assert entropy is not None
        if bonus > 0:  # the bonus: minus coef times the aggregated entropy
            loss = loss - bonus * aggregate(entropy, t["mask"], self.loss_cfg)
        if batch.teacher_topk_ids:  # dense on-policy distillation: position j - 1 predicts token j
            targets = [x[:, 1:] for x in self._distill_targets(batch, logits.shape[-1])]
            distill, distill_stats = distill_loss(
                logits, *targets, t["mask"][:, 1:], self.loss_cfg, beta=batch.distill_beta
            )
            loss, stats = loss + distill, stats | distill_stats
        del logits  # the graph keeps what backward needs; the float32 copy goes now
        stats["entropy"] = float((entropy.detach() * t["mask"]).sum() / t["mask"].sum().clamp(min=1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.steps += 1
        stats |= mismatch_stats(lp.detach(), t["behaviour"], t["mask"], t["versions"], batch.policy_version)
        return {
            "loss": loss.item(),
            "grad_norm": float(grad_norm),
            "lr": lr,
            **stats,
        }

    @staticmethod
    def _distill_targets(batch: TrainBatch, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's teacher top-k ids and logprobs ``[rows, seq, k]`` and ``distill_coef``
        ``[rows, seq]``, right-padded (pads: id 0, logprob 0, coefficient 0); checked first: k
        per token, every id inside the student's ``vocab``."""
        batch.validate()
        k, lens = batch.teacher_top_k, batch.row_lens
        flat = torch.tensor(batch.teacher_topk_ids, dtype=torch.long)
        if len(outside := flat[(flat < 0) | (flat >= vocab)]):
            raise ValueError(
                f"TrainBatch.teacher_topk_ids holds id {int(outside[0])}, outside the student's vocabulary "
                f"[0, {vocab}) (a teacher with another vocabulary needs a tokenizer mapping)"
            )
        ids = flat.view(-1, k).split(lens)
        logprobs = torch.tensor(batch.teacher_topk_logprobs, dtype=torch.float32).view(-1, k).split(lens)
        pad = torch.nn.utils.rnn.pad_sequence
        return (
            pad(list(ids), batch_first=True),
            pad(list(logprobs), batch_first=True),
            _pad(batch.distill_coef, lens, 0.0, torch.float32),
        )

    @torch.no_grad()
    def _no_grad_logprobs(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The proximal (decoupled PPO) and reference (KL) logprobs the loss options ask for."""
        out = {}
        if self.loss_cfg.decoupled:
            out["proximal"] = token_logprobs(self.model, ids, self.temperature)
        if self.reference is not None:
            out["reference"] = token_logprobs(self.reference, ids, self.temperature)
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.named_parameters()}

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)

    def save_state(self, path: str | Path) -> None:
        """The HF checkpoint plus ``optimizer.pt``: optimizer, LR scheduler, step count."""
        self.save_pretrained(path)
        state = {"opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "steps": self.steps}
        torch.save(state, Path(path) / "optimizer.pt")

    @torch.no_grad()
    def load_state(self, path: str | Path) -> None:
        """Weights copied in place (the optimizer keeps its parameters; a KL reference stays the
        initial model), then ``optimizer.pt``."""
        self.model.load_state_dict(load_causal_lm(path, self.trust_remote_code).state_dict())
        state = torch.load(Path(path) / "optimizer.pt", weights_only=False)
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.steps = state["steps"]

    def close(self) -> None:
        pass


def _frozen_copy(model: CausalLM) -> CausalLM:
    return copy.deepcopy(model).eval().requires_grad_(False)
