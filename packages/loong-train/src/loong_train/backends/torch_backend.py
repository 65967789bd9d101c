"""The torch train backend: recompute logprobs, take PPO/GRPO steps, export HF-named weights.

The loss is :func:`loong_train.algo.losses.policy_loss` under a :class:`LossConfig`. A KL penalty
scores the batch with a frozen copy of the initial model first (the reference policy, kept only
when ``kl_coef > 0``, one no-grad forward). Decoupled PPO's proximal policy is the weights before
this step's update, and there is one optimizer step per batch, so its logprobs are the train
forward's own (detached): no second forward is run for them. A batch carrying teacher top-k
targets (on-policy distillation) adds :func:`~loong_train.algo.losses.distill_loss`, on logits
computed one micro-batch at a time.

The forward packs rows end to end into micro-batches of at most ``max_tokens_per_micro_batch``
computed tokens, with no padding and a prefix shared with the row before computed once (Loong's
decoder; the generic ``transformers`` path runs rows whole), and takes logprobs with the LM head in chunks
(:mod:`loong_train.backends.packing`); the gradients of the micro-batches add up to the whole
batch's. The logprob of token j comes from the logits at position j - 1, divided by the sampling
temperature exactly as the engine did. :func:`token_logprobs` is the plain padded computation, the
reference the packed one is tested against.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import threading
from pathlib import Path
from typing import Any

import torch

from loong_core.records import TrainBatch
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import aggregate, distill_loss, policy_loss
from loong_train.backends import lora as lora_adapters
from loong_train.backends import packing
from loong_train.backends.config import LoraConfig
from loong_train.backends.metrics import mismatch_stats
from loong_train.models.auto import load_causal_lm
from loong_train.models.decoder import CausalLM
from loong_train.models.prepack import prepacked
from loong_train.models.tokenizer import copy_model_files

__all__ = ["TorchBackend", "logprobs_and_entropy", "token_logprobs"]


def token_logprobs(model: CausalLM, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logprob of each token given its prefix: [rows, seq] -> [rows, seq] (column 0 is 0)."""
    return logprobs_and_entropy(model, ids, temperature, None)[0]


def logprobs_and_entropy(
    model: CausalLM, ids: torch.Tensor, temperature: float, entropy_grad: bool | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` and, unless ``entropy_grad`` is None, each position's entropy
    H_t = -sum_v p(v) log p(v) of the sampling distribution (with a gradient when ``entropy_grad``)."""
    logits = model(ids)[:, :-1]
    return _from_logits(
        logits.float() if logits.dtype.itemsize < 4 else logits, ids, temperature, entropy_grad
    )


def _from_logits(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, entropy_grad: bool | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_and_entropy` from the logits (float32 or wider) that predict tokens 1.. of ``ids``."""
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

    prepack_scoring = True  # no-grad logprobs from prepacked weights (loong_train.models.prepack)

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
        max_tokens_per_micro_batch: int = 0,
        lora: LoraConfig | None = None,
        source: str | Path = "",
        reference: CausalLM | None = None,
    ) -> None:
        self.model = model.train()
        self.lora = lora if lora is not None and lora.enabled else None
        self.peft_config = lora_adapters.add_adapters(model, self.lora) if self.lora else None
        self.source = str(source)  # the checkpoint loaded: an adapter's base
        trained = [p for p in model.parameters() if p.requires_grad]
        self._optimizer_args = (trained, lr, weight_decay, warmup_steps)
        # what the first optimizer imports, on a thread: a trainer is up without it
        self._warm = threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True)
        self._warm.start()
        self.grad_clip, self.temperature = grad_clip, temperature
        self.max_tokens = max_tokens_per_micro_batch
        self.loss_cfg = loss or LossConfig()
        # the KL penalty's reference: the initial model (with LoRA: the base, adapters switched off)
        if reference is None and self.loss_cfg.kl_coef > 0 and not self.lora:
            reference = _frozen_copy(model)
        self.reference = reference
        self.steps = 0
        self.trust_remote_code = False

    @functools.cached_property
    def _optimizer(self) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW and its warmup, built on first use: a process's first optimizer imports
        ``torch._dynamo`` (3-5 s on a CPU core), which a trainer then imports on a thread while the
        first rollouts run, instead of before they start."""
        self._warm.join()
        trained, lr, weight_decay, warmup_steps = self._optimizer_args
        opt = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))

    @property
    def opt(self) -> torch.optim.AdamW:
        return self._optimizer[0]

    @property
    def sched(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self._optimizer[1]

    @classmethod
    def from_pretrained(
        cls, path: str | Path, trust_remote_code: bool = False, **kwargs: Any
    ) -> TorchBackend:
        """The checkpoint at ``path`` on the implementation :func:`load_causal_lm` picks."""
        backend = cls(load_causal_lm(path, trust_remote_code), source=path, **kwargs)
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

    def models(self) -> list[torch.nn.Module]:
        """The models a train step runs: the policy, and the KL reference where there is one."""
        return [self.model] if self.reference is None else [self.model, self.reference]

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.model.eval()  # no adapter dropout
        try:
            return self._no_grad_logprobs(self.model, batch)
        finally:
            self.model.train()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``, its gradient accumulated over packed micro-batches;
        returns loss and train-inference mismatch stats."""
        t = self.tensors(batch)
        cfg, bonus = self.loss_cfg, self.loss_cfg.entropy_coef
        reference = None
        if self.reference is not None:
            reference = self._no_grad_logprobs(self.reference, batch, t["mask"])
        elif self.lora and cfg.kl_coef > 0:
            with lora_adapters.disabled(self.model):
                reference = self._no_grad_logprobs(self.model, batch, t["mask"])
        distill = (
            self._distill_targets(batch, self.model.config.vocab_size) if batch.teacher_topk_ids else None
        )
        lp_all = torch.zeros(t["mask"].shape, dtype=self._dtype)
        entropy_all = torch.zeros_like(lp_all)
        total, distill_stats = 0.0, {}
        self.opt.zero_grad(set_to_none=True)
        for micro, counts in self._micro_batches(batch):
            part = {k: v[micro.rows, : micro.width] for k, v in t.items()}
            hidden = self.model.packed_hidden(micro.ids, micro.layout)
            lp, entropy = packing.logprobs(
                self.model, micro, self.temperature, bonus > 0, part["mask"], hidden
            )
            assert entropy is not None
            ref = None if reference is None else reference[micro.rows, : micro.width]
            loss, _ = policy_loss(lp, part["behaviour"], part["adv"], part["mask"], cfg, reference=ref)
            if bonus > 0:  # the bonus: minus coef times the aggregated entropy
                loss = loss - bonus * aggregate(entropy, part["mask"], cfg)
            loss = loss * packing.share(part["mask"], t["mask"], cfg)
            if distill is not None:  # dense on-policy distillation: position j - 1 predicts token j
                targets = [x[micro.rows, 1 : micro.width] for x in distill]
                term, stats = self._distill(
                    micro, hidden, targets, part["mask"], t["mask"], batch.distill_beta
                )
                loss = loss + term
                if counts:
                    distill_stats = {k: distill_stats.get(k, 0.0) + v for k, v in stats.items()}
            if not counts:  # a data-parallel rank keeping step with the others: no gradient
                loss = loss * 0.0
            if not loss.requires_grad:  # no loss token in these rows: a zero gradient all the same
                loss = loss + 0.0 * hidden.sum()  # (a sharded model's backward is a collective)
            loss.backward()
            if counts:
                total += loss.item()
                lp_all[micro.rows, : micro.width] = lp.detach()
                entropy_all[micro.rows, : micro.width] = entropy.detach()
        total, distill_stats = self._combine([lp_all, entropy_all], total, distill_stats)
        with torch.no_grad():  # the statistics, over the whole batch
            _, stats = policy_loss(lp_all, t["behaviour"], t["adv"], t["mask"], cfg, reference=reference)
        stats |= distill_stats
        stats["entropy"] = float((entropy_all * t["mask"]).sum() / t["mask"].sum().clamp(min=1))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor (sharded parameters)
            grad_norm = grad_norm.full_tensor()
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.steps += 1
        stats |= mismatch_stats(lp_all, t["behaviour"], t["mask"], t["versions"], batch.policy_version)
        return {"loss": total, "grad_norm": float(grad_norm), "lr": lr, **stats}

    def _distill(
        self,
        micro: packing.MicroBatch,
        hidden: torch.Tensor,
        targets: list[torch.Tensor],
        mask: torch.Tensor,
        whole: torch.Tensor,
        beta: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's share of the distillation loss, and its share of the statistics
        (token-weighted). Its logits [rows, width - 1, vocab] are computed whole: distillation
        needs every logit of a position (the student's tail mass)."""
        logits = self.model.head(micro.pad(hidden)[:, :-1]).float()
        mask, whole = mask[:, 1:], whole[:, 1:]
        term, stats = distill_loss(logits, *targets, mask, self.loss_cfg, beta=beta)
        tokens = float(mask.sum()) / max(1.0, float(whole.sum()))
        return term * packing.share(mask, whole, self.loss_cfg), {k: v * tokens for k, v in stats.items()}

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
    def _no_grad_logprobs(
        self, model: CausalLM, batch: TrainBatch, wanted: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``model``'s logprobs of the batch, [rows, max_len], packed and chunked like the train
        forward (only where ``wanted`` is nonzero, when given), the products from prepacked
        weights (:mod:`loong_train.models.prepack`; dropped afterwards) where the backend allows."""
        out = torch.zeros(len(batch.row_lens), max(batch.row_lens), dtype=self._dtype)
        with prepacked(model) if self.prepack_scoring else contextlib.nullcontext():
            for micro, counts in self._micro_batches(batch):
                part = None if wanted is None else wanted[micro.rows, : micro.width]
                lp = packing.logprobs(model, micro, self.temperature, None, part)[0]
                if counts:
                    out[micro.rows, : micro.width] = lp
        self._combine([out], 0.0, {})
        return out

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[packing.MicroBatch, bool]]:
        """The micro-batches this process computes, each with whether it counts: all of them,
        here; a data-parallel rank computes its share and repeats one without a gradient where
        it has fewer than another rank (:mod:`loong_train.backends.fsdp`)."""
        micros = packing.micro_batches(batch.token_ids, batch.row_lens, self.max_tokens, self._share)
        return [(m, True) for m in micros]

    def _combine(
        self, rows: list[torch.Tensor], total: float, stats: dict[str, float]
    ) -> tuple[float, dict[str, float]]:
        """Every process's share of a step put together: ``rows`` (per-row tensors, each process's
        rows filled, zeros elsewhere) in place, the loss ``total`` and summed ``stats``. One
        process holds everything already."""
        return total, stats

    @property
    def _share(self) -> bool:
        """Whether packed rows compute a shared prefix once (the model supports it)."""
        return getattr(self.model, "shares_prefixes", False)

    @property
    def _dtype(self) -> torch.dtype:
        """Logprobs' dtype: the model's, float32 at least."""
        return torch.promote_types(self.model.lm_head.weight.dtype, torch.float32)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """What a weight update sends: every weight under its Hugging Face name; with LoRA the
        adapters alone (``sync = "adapter"``) or every weight with them merged in."""
        if self.lora:
            if self.lora.sync == "adapter":
                return lora_adapters.adapter_weights(self.model)
            return lora_adapters.merged_weights(self.model)
        return {k: v.detach() for k, v in self.model.named_parameters()}

    def save_pretrained(self, path: str | Path) -> None:
        """The model as a Hugging Face checkpoint; with LoRA the adapter as ``peft`` saves one
        (and with ``save_merged`` the merged model under ``merged/``, tokenizer included)."""
        if not self.lora:
            self.model.save_pretrained(path)
            return
        lora_adapters.save_adapter(self.model, self.peft_config, path, base=self.source)
        if self.lora.save_merged:
            with lora_adapters.merged(self.model) as plain:
                plain.save_pretrained(Path(path) / "merged")
            if self.source:
                copy_model_files(self.source, Path(path) / "merged")

    def save_state(self, path: str | Path) -> None:
        """The HF checkpoint (with LoRA: the merged model, what a resumed run's engines load, and
        the adapter under ``adapter/``) plus ``optimizer.pt``: optimizer, LR scheduler, step count."""
        if self.lora:
            with lora_adapters.merged(self.model) as plain:
                plain.save_pretrained(path)
            lora_adapters.save_adapter(self.model, self.peft_config, Path(path) / "adapter", base=self.source)
        else:
            self.save_pretrained(path)
        state = {"opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "steps": self.steps}
        torch.save(state, Path(path) / "optimizer.pt")

    @torch.no_grad()
    def load_state(self, path: str | Path) -> None:
        """Weights copied in place (the optimizer keeps its parameters; a KL reference stays the
        initial model; with LoRA only the adapter is loaded, onto the same base), then ``optimizer.pt``."""
        if self.lora:
            lora_adapters.load_adapter(self.model, Path(path) / "adapter")
        else:
            self.model.load_state_dict(load_causal_lm(path, self.trust_remote_code).state_dict())
        state = torch.load(Path(path) / "optimizer.pt", weights_only=False)
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.steps = state["steps"]

    def close(self) -> None:
        pass


def _frozen_copy(model: CausalLM) -> CausalLM:
    return copy.deepcopy(model).eval().requires_grad_(False)
