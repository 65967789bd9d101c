"""The Megatron train backend: a megatron-core GPTModel with tensor and pipeline parallelism.

Same surface and semantics as :class:`~loong_train.backends.torch_backend.TorchBackend`:
``logprobs(batch)``, ``train_step(batch)`` with :func:`loong_train.algo.losses.policy_loss`
(decoupled PPO's proximal forward and the KL reference model included), AdamW with betas
(0.9, 0.99), linear warmup and global-norm gradient clipping, and ``named_weights()`` in Hugging
Face naming. It is SPMD: each of the ``tp * pp`` ranks of an initialised ``torch.distributed``
world builds one ``MegatronBackend`` and makes the same calls in the same order; results
(logprobs, metrics, weights) are returned on every rank.

Model. :func:`~loong_train.backends.megatron.model.gpt_model` builds a Hugging Face config of a
fast decoder family as a megatron-core ``GPTModel`` (:mod:`~loong_train.backends.megatron.model`
says which configs it covers). Weights are loaded
with :func:`~loong_train.backends.megatron.weights.hf_to_megatron` and exported by gathering the
tensor-parallel shards, converting them with :func:`loong_transfermesh.megatron_to_hf`, and
broadcasting each pipeline stage's tensors to the other stages.

Logprobs. The last stage keeps vocabulary-parallel logits ``[rows, seq, V / tp]``, divides them
by the sampling temperature, masks the padded vocabulary columns with -inf, and takes
``log p(ids[j] | ids[<j]) = -vocab_parallel_cross_entropy(logits[j - 1], ids[j])``; column 0
is 0, as in the torch backend. Rows are right-padded and attention is causal, so no padding mask.

Parallelism. megatron-core's schedule (``get_forward_backward_func``) runs the step, 1F1B
across pipeline stages. By default the whole batch is one micro-batch and the loss is computed
and differentiated on the last stage. With ``micro_batch_rows = m`` the rows are split into
micro-batches of m (the last padded with empty rows) and the whole-batch loss is linearised: a
no-grad forward gives the logprobs l and g = dL/dl, and micro-batch k back-propagates g_k . l_k,
so the gradient is exactly the whole batch's for every loss option. With tied embeddings and
PP > 1 the embedding and output-layer gradients are summed over the embedding group before
clipping, and the q/k norm gradients over TP, as megatron-core's ``finalize_model_grads`` does.
Data parallelism (world = dp * tp * pp): each data-parallel rank takes an equal share of the
micro-batches, the logprobs of the no-grad forward are all-gathered so every rank computes the
whole-batch L and g, and the gradients are summed over the data-parallel group. The gradient
norm counts each parameter once (no TP duplicates, no shared embedding copy) and is summed over
the model-parallel group.

megatron-core is imported lazily, inside the functions that use it; on a CPU host every call into it runs
inside :func:`~loong_train.backends.megatron.cpu.cpu_compat` (a no-op with CUDA).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loong_core.records import TrainBatch
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import policy_loss
from loong_train.backends.megatron.batch import batch_tensors
from loong_train.backends.megatron.cpu import cpu_compat
from loong_train.backends.megatron.model import gpt_model, megatron_problem
from loong_train.backends.megatron.weights import gather_hf_weights, hf_to_megatron
from loong_train.backends.metrics import mismatch_stats
from loong_train.models.decoder import DecoderConfig
from loong_transfermesh import MegatronLayout

__all__ = ["MegatronBackend"]


class MegatronBackend:
    """AdamW with linear warmup, gradient clipping, one optimizer step per batch (SPMD)."""

    def __init__(
        self,
        hf_config: Mapping,
        hf_weights: Mapping[str, torch.Tensor],
        *,
        lr: float,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        loss: LossConfig | None = None,
        temperature: float = 1.0,
        micro_batch_rows: int = 0,
    ) -> None:
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.cfg = DecoderConfig.from_hf(dict(hf_config))
        if problem := megatron_problem(self.cfg):
            raise ValueError(f"the megatron backend cannot train this model: {problem}")
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.layout = MegatronLayout.from_hf_config(dict(hf_config), tp=self.tp)
        self.padded_vocab = math.ceil(self.cfg.vocab_size / self.tp) * self.tp
        self.layers_per_stage = self.cfg.num_hidden_layers // self.pp
        self.first_layer = ps.get_pipeline_model_parallel_rank() * self.layers_per_stage
        self.is_last = ps.is_pipeline_last_stage()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.model = self._build(hf_weights)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99)
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps))
        )
        self.grad_clip, self.temperature = grad_clip, temperature
        self.micro_batch_rows = micro_batch_rows  # 0: one micro-batch per data-parallel rank
        self.loss_cfg = loss or LossConfig()
        self.reference = (
            self._build(hf_weights).eval().requires_grad_(False) if self.loss_cfg.kl_coef > 0 else None
        )
        self.steps = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> MegatronBackend:
        """From a Hugging Face checkpoint directory (``config.json`` + ``model.safetensors`` or shards)."""
        import json

        from loong_train.models.decoder import load_hf_weights

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        return cls(config, load_hf_weights(path), **kwargs)

    def _build(self, hf_weights: Mapping[str, torch.Tensor]):
        model = gpt_model(
            self.cfg,
            self.tp,
            self.pp,
            vocab_size=self.padded_vocab,
            pre_process=self.ps.is_pipeline_first_stage(),
            post_process=self.is_last,
        )
        # megatron-core allocates its parallel layers on the GPU, but the local spec's norms are
        # plain torch modules built on the CPU (Megatron's own trainer moves the model, too)
        model = model.to(self.device)
        self._load_into(model, hf_weights)
        return model.train()

    def _load_into(self, model, hf_weights: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's shard of ``hf_weights`` (Hugging Face names) into ``model``."""
        shard = hf_to_megatron(
            hf_weights,
            self.layout,
            tp_rank=self.tp_rank,
            first_layer=self.first_layer,
            num_layers=self.layers_per_stage,
            pre_process=model.pre_process,
            post_process=model.post_process,
            padded_vocab=self.padded_vocab,
        )
        params = dict(model.named_parameters())
        if missing := set(params) ^ set(shard):
            raise ValueError(f"megatron parameters and converted HF weights differ: {sorted(missing)}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(shard[name])

    # -- forward ---------------------------------------------------------------------------

    def _token_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel logits [rows, seq, V/tp] -> logprob of each token [rows, seq]."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.float() / self.temperature
        part = logits.shape[-1]
        real = self.cfg.vocab_size - self.tp_rank * part  # columns of this rank inside the vocabulary
        if real < part:
            logits = logits.masked_fill(torch.arange(part, device=logits.device) >= real, -math.inf)
        nll = vocab_parallel_cross_entropy(logits, ids.roll(-1, dims=1))
        return F.pad(-nll[:, :-1], (1, 0))

    def _run(self, model, chunks: list[torch.Tensor], loss_func, forward_only: bool) -> list:
        """Micro-batches ``chunks`` (equal shapes) through megatron-core's schedule;
        ``loss_func(k, logits)`` runs on the last stage for micro-batch k and returns
        (loss, info). Returns the infos in order on the last stage, [] elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows, seq = chunks[0].shape
        positions = torch.arange(seq, device=self.device).expand(rows, seq)
        masked = torch.ones(seq, seq, dtype=torch.bool, device=self.device).triu(1)[None, None]

        def forward_step(data, m):
            k, ids = next(data)
            return m(ids, positions, masked), functools.partial(loss_func, k)

        with cpu_compat():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(enumerate(chunks)),
                model=[model],
                num_microbatches=len(chunks),
                seq_length=seq,
                micro_batch_size=rows,
                forward_only=forward_only,
            )

    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Rows -> this data-parallel rank's micro-batches: the rows are padded with empty rows so
        that every rank gets the same number of ``micro_batch_rows``-row micro-batches."""
        rows = x.shape[0]
        size = self.micro_batch_rows or math.ceil(rows / self.dp)
        per_rank = math.ceil(rows / (self.dp * size)) * size
        x = F.pad(x, (0, 0, 0, per_rank * self.dp - rows))
        return list(x[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank].split(size))

    @torch.no_grad()
    def _forward_logprobs(self, model, ids: torch.Tensor) -> torch.Tensor:
        chunks = self._split(ids)

        def collect(k, logits):
            lp = self._token_logprobs(logits, chunks[k])
            return lp.new_zeros(()), {"logprobs": lp}

        out = self._run(model, chunks, collect, forward_only=True)
        lp = self._from_last_stage(torch.cat([o["logprobs"] for o in out]) if out else None)
        if self.dp > 1:
            parts = [torch.empty_like(lp) for _ in range(self.dp)]
            dist.all_gather(parts, lp, group=self.ps.get_data_parallel_group())
            lp = torch.cat(parts)
        return lp[: ids.shape[0]]

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[rows, max_len] logprobs of the batch's tokens under the current weights (column 0 is 0)."""
        return self._forward_logprobs(self.model, batch_tensors(batch, self.device)["ids"])

    # -- train -----------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns loss and train-inference mismatch stats."""
        t = batch_tensors(batch, self.device)
        extra = {}
        whole = self.dp == 1 and len(self._split(t["ids"])) == 1
        if self.loss_cfg.decoupled or not whole:
            extra["proximal"] = self._forward_logprobs(self.model, t["ids"])
        if self.reference is not None:
            extra["reference"] = self._forward_logprobs(self.reference, t["ids"])
        self.opt.zero_grad(set_to_none=True)
        if whole:
            out = self._backward_whole(t, extra, batch.policy_version)
        else:
            out = self._backward_linearised(t, extra, batch.policy_version)
        self._finalize_grads()
        grad_norm = self._clip_grads()
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.steps += 1
        stats = self._from_last_stage(out)
        return {"loss": stats.pop("loss"), "grad_norm": grad_norm, "lr": lr, **stats}

    def _backward_whole(self, t: dict, extra: dict, version: int) -> dict | None:
        """The batch as one micro-batch: the loss is computed and differentiated on the last stage."""

        def loss_func(_k, logits):
            lp = self._token_logprobs(logits, t["ids"])
            return self._loss(lp, t, extra, version)

        out = self._run(self.model, [t["ids"]], loss_func, forward_only=False)
        return out[0] if out else None

    def _backward_linearised(self, t: dict, extra: dict, version: int) -> dict:
        """Several micro-batches, the gradient still exactly that of the whole-batch loss L.

        L depends on the weights only through the logprobs l, so dL/dtheta = sum_k g_k . dl_k/dtheta
        with g = dL/dl at the current l (the no-grad forward in ``extra["proximal"]``). Micro-batch
        k back-propagates the surrogate (g_k . l_k) * K, K of them (the schedule divides by K).
        This holds for every aggregation, clip, mask and KL option of the loss unchanged."""
        lp = extra["proximal"].clone().requires_grad_()
        if not self.loss_cfg.decoupled:
            extra = {k: v for k, v in extra.items() if k != "proximal"}
        loss, info = self._loss(lp, t, extra, version)
        loss.backward()
        grads = self._split(lp.grad)

        def loss_func(k, logits):
            surrogate = (self._token_logprobs(logits, ids[k]) * grads[k]).sum() * len(grads)
            return surrogate, {}

        ids = self._split(t["ids"])
        self._run(self.model, ids, loss_func, forward_only=False)
        return info

    def _loss(self, lp: torch.Tensor, t: dict, extra: dict, version: int) -> tuple[torch.Tensor, dict]:
        loss, stats = policy_loss(lp, t["behaviour"], t["adv"], t["mask"], self.loss_cfg, **extra)
        stats |= mismatch_stats(lp.detach(), t["behaviour"], t["mask"], t["versions"], version)
        return loss, {"loss": loss.item(), **stats}

    def _finalize_grads(self) -> None:
        """The gradient reductions of megatron-core's ``finalize_model_grads`` that apply here:
        a sum over data-parallel replicas; over TP for the per-head q/k norm weights, which see
        only this rank's heads; and, with tied embeddings split over stages, over the embedding
        group, so the embedding and output-layer copies take the same step."""
        if self.dp > 1:
            group = self.ps.get_data_parallel_group()
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=group)
        if self.tp > 1:
            group = self.ps.get_tensor_model_parallel_group()
            for name, p in self.model.named_parameters():
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=group)
        if self.pp > 1 and self.cfg.tie_word_embeddings and self.ps.is_rank_in_embedding_group():
            weight = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(weight.grad, group=self.ps.get_embedding_group())

    def _clip_grads(self) -> float:
        """torch's ``clip_grad_norm_`` over the whole model: scale by min(1, c / (norm + 1e-6))."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        params = [p for p in self.model.parameters() if p.grad is not None]
        counted = [
            p.grad for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
        ]
        sq = (
            torch.stack([g.pow(2).sum() for g in counted]).sum()
            if counted
            else torch.zeros((), device=self.device)
        )
        dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        norm = sq.sqrt()
        scale = (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(scale)
        return float(norm)

    # -- weights ---------------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The full model in Hugging Face naming, on every rank."""
        return gather_hf_weights(
            self.model.named_parameters(),
            self.layout,
            first_layer=self.first_layer,
            tp_group=self.ps.get_tensor_model_parallel_group(),
            pp_group=self.ps.get_pipeline_model_parallel_group(),
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Rank 0 writes an HF checkpoint (config.json + model.safetensors)."""
        from safetensors.torch import save_file

        path = Path(path)
        weights = self.named_weights()
        if dist.get_rank() == 0:
            import json

            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text(json.dumps(self.cfg.to_hf(), indent=2))
            save_file(weights, str(path / "model.safetensors"))
        dist.barrier()

    def save_state(self, path: str | Path) -> None:
        """The HF checkpoint, and each rank of the first data-parallel replica writes its optimizer
        shard, LR scheduler and step count to ``optimizer.tp{r}.pp{s}.pt`` (the replicas hold
        the same state)."""
        self.save_pretrained(path)
        if self.dp_rank == 0:
            state = {"opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "steps": self.steps}
            torch.save(state, self._state_file(path))
        dist.barrier()

    @torch.no_grad()
    def load_state(self, path: str | Path) -> None:
        """Continue from ``save_state(path)``: every rank converts the HF weights into its shard
        (copied in place; a KL reference stays the initial model) and loads its optimizer file."""
        from loong_train.models.decoder import load_hf_weights

        self._load_into(self.model, load_hf_weights(Path(path)))
        state = torch.load(self._state_file(path), weights_only=False, map_location=self.device)
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.steps = state["steps"]

    def _state_file(self, path: str | Path) -> Path:
        return Path(path) / f"optimizer.tp{self.tp_rank}.pp{self.ps.get_pipeline_model_parallel_rank()}.pt"

    def _from_last_stage(self, value):
        """Broadcast a tensor or picklable value held by the last pipeline stage to all stages."""
        if self.pp == 1:
            return value
        box = [value]
        dist.broadcast_object_list(
            box,
            src=self.ps.get_pipeline_model_parallel_last_rank(),
            group=self.ps.get_pipeline_model_parallel_group(),
        )
        return box[0]
