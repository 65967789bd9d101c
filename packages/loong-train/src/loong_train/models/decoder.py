"""The Llama-style decoder family in plain torch, with Hugging Face names and files.

The same module serves the trainer (full-sequence forward) and the embedded engine
(prefill + decode against a preallocated KV cache), so rollout and training logprobs come
from one implementation. Parameter names equal those of each family's ``transformers`` class, so a
checkpoint directory (``config.json`` + ``model.safetensors``, or shards listed in
``model.safetensors.index.json`` as the hub ships larger models) loads in either; a test checks
logits against ``transformers`` as an independent reference.

Architecture: pre-norm decoder; RMSNorm; grouped-query attention; rotary position embedding
(rotate-half form); SwiGLU MLP; optional tied embeddings. The families differ only in
config-driven ways, read from ``config.json``'s ``model_type``:

- ``qwen3``: per-head RMSNorm on queries and keys (QK-norm), no biases;
- ``qwen2`` (Qwen2, Qwen2.5): biases on the query, key and value projections;
- ``llama`` (Llama 2/3, SmolLM, TinyLlama): no biases (``attention_bias``, ``mlp_bias`` honoured),
  ``head_dim`` defaulting to ``hidden_size / num_attention_heads``, rope scaling ``llama3`` or
  ``linear``;
- ``mistral``: Llama's layout; a ``sliding_window`` shorter than ``max_position_embeddings`` is
  refused (full attention would silently differ past the window).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loong_train.models.packed import PackedRows
from loong_train.models.prepack import Linear, stacked

__all__ = ["ARCHITECTURES", "CausalLM", "DecoderConfig", "KVCache", "load_hf_weights", "weight_files"]

ARCHITECTURES = {
    "qwen3": "CausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` lists (Qwen3-1.7B and larger ship sharded); raises
    ValueError naming what is missing."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not index.exists():
        if not (path / "model.safetensors").is_file():
            raise ValueError(
                f"{path} has no weights: expected model.safetensors or model.safetensors.index.json "
                "and its shards (pytorch_model.bin is not read: save with safe_serialization)"
            )
        return [path / "model.safetensors"]
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if missing := [s for s in shards if not (path / s).is_file()]:
        raise ValueError(f"{path}: {index.name} lists shards the directory lacks: {', '.join(missing)}")
    return [path / s for s in shards]


def load_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint directory (:func:`weight_files`)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        weights.update(load_file(str(file)))
    return weights


@dataclass
class DecoderConfig:
    """The subset of a Hugging Face decoder config this implementation needs (see the module
    docstring for what each family sets)."""

    vocab_size: int
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    model_type: str = "qwen3"
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict | None = None

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, data: dict) -> DecoderConfig:
        kind = data.get("model_type")
        if kind not in ARCHITECTURES:
            raise ValueError(
                f"model_type {kind!r} is not one of the decoder families Loong implements "
                f"({', '.join(ARCHITECTURES)})"
            )
        names = {f.name for f in fields(cls)}
        cfg = {k: v for k, v in data.items() if k in names and v is not None}
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if "rope_theta" not in cfg and "rope_theta" in rope:
            cfg["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope scaling {rope_type!r} is not implemented (linear and llama3 are)")
        cfg["rope_scaling"] = rope if rope_type != "default" else None
        if "head_dim" not in cfg:
            cfg["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if kind == "qwen2":  # Qwen2 always biases q, k, v (its config has no attention_bias key)
            cfg["attention_bias"] = True
        cfg.setdefault("num_key_value_heads", data["num_attention_heads"])
        window = data.get("sliding_window") if data.get("use_sliding_window", kind == "mistral") else None
        if window is not None and window < cfg.get("max_position_embeddings", 512):
            raise ValueError(
                f"sliding_window = {window} < max_position_embeddings: sliding-window attention is not "
                "implemented (full attention would differ past the window)"
            )
        return cls(**cfg)

    def to_hf(self) -> dict:
        body = asdict(self)
        if body["rope_scaling"] is None:
            del body["rope_scaling"]
        if self.model_type == "qwen2":
            del body["attention_bias"], body["mlp_bias"]
        return {
            "architectures": [ARCHITECTURES[self.model_type]],
            "hidden_act": "silu",
            "torch_dtype": "float32",
            **body,
        }


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x^2) + eps))`` with the normalisation in float32 at least and
        the weight applied in ``x``'s dtype, as transformers computes it. On a CPU, ``F.rms_norm``
        without a weight runs those same operations (the same bits, forward and backward) in one
        call: a bfloat16 norm of a 128-row decode step takes 47 us against 88 as separate calls
        (a GPU's fused kernel agrees to rounding)."""
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(wide, wide.shape[-1:], None, self.eps).to(x.dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [b, heads, t, head_dim] by ``cos`` and ``sin`` [b, 1, t,
    head_dim] (in ``x``'s dtype): ``x * cos + rotate_half(x) * sin`` as transformers computes it
    (``rotate_half`` of ``[x1, x2]`` is ``[-x2, x1]``), to the bit, without building the rotated
    copy: subtracting ``x2 * sin`` rounds as adding its negation does."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def _scaled(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Rope scaling: ``linear`` divides every frequency by ``factor``; ``llama3`` divides the low
    frequencies by ``factor``, keeps the high ones and interpolates smoothly in between."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not implemented (linear and llama3 are)")
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    return torch.where((wavelen >= old / high) & (wavelen <= old / low), mid, out)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", _scaled(inv_freq, scaling), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [batch, seq] -> cos, sin [batch, 1, seq, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()


class KVCache:
    """Preallocated keys/values: per layer [batch, kv_heads, max_len, head_dim], zero-initialised
    (masked columns must hold finite values: a NaN would survive a zero attention weight).

    Continuous batching reshapes it between decode steps: ``view`` hands the model some rows from
    some column on (its writes land here), ``resized`` copies it into a new shape with the columns
    shifted, ``move_rows`` fills the slots of rows that left.
    """

    def __init__(self, cfg: DecoderConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> None:
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @classmethod
    def _of(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> KVCache:
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.max_len = k, v, k[0].shape[2]
        return cache

    def view(self, rows: slice, first_col: int) -> KVCache:
        """Rows ``rows`` from column ``first_col`` on, sharing storage (view column 0 = ``first_col``)."""
        return KVCache._of([t[rows, :, first_col:] for t in self.k], [t[rows, :, first_col:] for t in self.v])

    def resized(self, batch: int, max_len: int, shift: int = 0) -> KVCache:
        """A new zeroed cache [batch, ..., max_len] holding this one's rows with column ``c`` moved
        to ``c + shift`` (columns that fall outside are dropped)."""
        rows = min(batch, self.batch)
        lo, hi = max(0, -shift), min(self.max_len, max_len - shift)

        def copy(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((batch, t.shape[1], max_len, t.shape[3]))
            out[:rows, :, lo + shift : hi + shift] = t[:rows, :, lo:hi]
            return out

        return KVCache._of([copy(t) for t in self.k], [copy(t) for t in self.v])

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, cols: slice = slice(None)) -> None:
        """Copy columns ``cols`` of rows ``src`` into rows ``dst`` (index tensors of one length)."""
        for t in (*self.k, *self.v):
            t[dst, :, cols] = t[src, :, cols]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        o_bias = bias and cfg.model_type != "qwen2"  # Qwen2 biases q, k, v only
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x, cos, sin, mask, cache: tuple[torch.Tensor, torch.Tensor] | None, start: int, rows=None
    ):
        b, t, _ = x.shape
        q, k, v = stacked((self.q_proj, self.k_proj, self.v_proj), x)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        if cache is not None:
            cache[0][:, :, start : start + t] = k
            cache[1][:, :, start : start + t] = v
            k, v = cache[0][:, :, : start + t], cache[1][:, :, : start + t]
        gqa = self.n_heads != self.n_kv  # keys and values are shared by head groups, never copied
        if rows is not None:  # packed rows: each attends causally within itself and its shared prefix
            out = rows.attend(q, k, v, gqa)
        elif t == 1 and mask is not None and q.device.type == "cpu":
            out = _decode_attention(q, k, v, mask)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query position per row (a decode step): q [b, heads, 1, d], k and v [b, kv_heads, c, d],
    mask [b, 1, 1, c] True where allowed, at least once per row. The query heads sharing a key
    head form one matrix against it (head ``h`` reads key head ``h // (heads / kv_heads)``, as
    ``enable_gqa`` does), which runs about 2x faster on CPU than the fused kernel does for a single
    query position. The softmax runs in float32 at least.

    Float32 (or wider) takes ``queries @ keys^T``; bfloat16's batched product copies a transposed
    operand as large as the keys, so there the scores are taken as ``keys @ queries^T`` ([c,
    group] per head), 1.4x faster for a 128-row step, and viewed back as [group, c] for the
    softmax in float32 (over the last dimension of that view: 3x faster than over the
    second-to-last of the product's own layout)."""
    b, heads, _, d = q.shape
    kv = k.shape[1]
    grouped = q.view(b, kv, heads // kv, d)
    if q.dtype.itemsize >= 4:
        scores = (grouped @ k.transpose(-1, -2)).mul_(d**-0.5)  # [b, kv_heads, group, c]
    else:
        scores = (k @ grouped.transpose(-1, -2)).transpose(-1, -2).float().mul_(d**-0.5)
    weights = scores.masked_fill_(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return (weights @ v).view(b, heads, 1, d)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # nothing reads gate or up again


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, start, rows=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, start, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


class CausalLM(nn.Module):
    """A decoder-family causal LM. ``forward`` returns logits [batch, seq, vocab].

    Training: ``forward(ids)`` with right padding needs no mask (causal attention never lets a
    real token see a later pad); ``packed_hidden(ids, rows)`` takes rows concatenated instead
    (no padding at all) and returns the final hidden states, which ``head`` maps to logits.
    Generation: ``forward(ids, positions, mask, cache, start)`` with a boolean ``mask``
    [batch, 1, seq, start + seq] that is True where attention is allowed; ``last_only`` computes
    the logits of the last position only (a prefill needs no others).
    """

    shares_prefixes = True  # packed_hidden computes a prefix rows share once

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic random init (normal(0, std) matrices, ones for norms), as HF does."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        last_only: bool = False,
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self._layers(input_ids, positions, mask, cache, start)
        return self.head(self.model.norm(x[:, -1:] if last_only else x))

    def packed_hidden(self, ids: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        """Hidden states [tokens, hidden] that ``head`` maps to logits, of rows packed end to end
        in ``ids`` [tokens] (``rows``: their lengths and shared prefixes): positions restart and
        attention stays inside each row, so every row gets what it would compute alone; no
        position is padding and a shared prefix is computed once (:mod:`loong_train.models.packed`)."""
        device = ids.device
        computed = ids[rows.computed.to(device)]
        x = self._layers(computed[None], rows.positions.to(device)[None], None, None, 0, rows)[0]
        return self.model.norm(x)[rows.index.to(device)]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: final hidden states -> logits. From the prepacked weight where
        it runs (:mod:`loong_train.models.prepack`); otherwise in float32 taken as ``W @ h^T``
        (then viewed back), which runs 1.2-1.4x faster on CPU than ``h @ W^T`` for a
        vocabulary-wide head; in bfloat16 both run alike, and ``h @ W^T``'s row-major logits
        convert to float32 for sampling about 10x faster than the transposed ones."""
        if self.lm_head.runs_prepacked(hidden):
            return self.lm_head(hidden)
        weight = self.lm_head.weight
        if weight.dtype != torch.float32:
            return F.linear(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return (weight @ flat.T).T.reshape(*hidden.shape[:-1], -1)

    def _layers(self, input_ids, positions, mask, cache, start, rows=None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = (t.to(x.dtype) for t in self.model.rotary(positions))
        for i, layer in enumerate(self.model.layers):
            layer_cache = (cache.k[i], cache.v[i]) if cache is not None else None
            x = layer(x, cos, sin, mask, layer_cache, start, rows)
        return x

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters in Hugging Face naming (tied lm_head omitted, as HF saves it)."""
        sd = {k: v for k, v in self.state_dict().items() if "rotary" not in k}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2))
        save_file(
            {k: v.contiguous() for k, v in self.hf_state_dict().items()}, str(path / "model.safetensors")
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> CausalLM:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        cfg = DecoderConfig.from_hf(json.loads((path / "config.json").read_text()))
        model = cls(cfg)
        missing, unexpected = model.load_state_dict(load_hf_weights(path), strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path} does not match its {cfg.model_type} config: missing {missing}, "
                f"unexpected {unexpected}"
            )
        return model

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
