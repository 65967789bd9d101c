"""Prepacked linear layers (loong_train.models.prepack): the blocked weight gives the product of
the weight as it is now, against float64, through every way the weight changes."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

from loong_train.backends.packing import _picked
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.models.decoder import CausalLM, DecoderConfig
from loong_train.models.prepack import (
    MIN_ELEMENTS,
    Linear,
    available,
    dtypes,
    prepack,
    prepacked,
    release,
    stacked,
)

pytestmark = pytest.mark.skipif(not available(), reason="prepacking needs oneDNN on an x86-64 CPU")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the output's scale
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(torch.bfloat16 not in dtypes(), reason="no oneDNN bfloat16 on this CPU"),
    ),
]


IN, OUT = 384, 512  # a weight large enough to prepack (MIN_ELEMENTS)
# hidden 384: the query and MLP projections and the head prepack, the keys' and values' only stacked
# with the query's (`stacked`)
CFG = DecoderConfig(vocab_size=512, hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=64)  # fmt: skip


def _layer(dtype: torch.dtype, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return prepack(Linear(IN, OUT, bias=True)).to(dtype)


def _close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """``out`` equals ``x @ weight^T + bias`` computed in float64, to ``out``'s dtype's rounding."""
    ref = x.double() @ weight.double().T + bias.double()
    return bool((out.double() - ref).abs().max() <= TOL[out.dtype] * ref.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, IN), (128, IN), (3, 5, IN)])
def test_a_prepacked_layer_computes_its_product(dtype, shape):
    layer = _layer(dtype)
    x = torch.randn(shape).to(dtype)
    with torch.no_grad():
        assert layer.runs_prepacked(x)
        out = layer(x)
    assert out.shape == (*shape[:-1], OUT) and out.dtype == dtype
    assert _close(out, x, layer.weight, layer.bias)


def test_a_small_weight_runs_the_plain_product():
    layer = prepack(Linear(128, MIN_ELEMENTS // 128 - 1))
    x = torch.randn(8, 128)
    with torch.no_grad():
        assert not layer.runs_prepacked(x)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer._blocked.entry is None


def test_a_forward_that_needs_a_gradient_runs_the_plain_product():
    layer = _layer(torch.float32)
    x = torch.randn(4, IN, requires_grad=True)
    assert not layer.runs_prepacked(x)
    out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_blocked_copy_follows_every_change_of_the_weight(dtype):
    layer = _layer(dtype)
    x = torch.randn(16, IN).to(dtype)
    with torch.no_grad():
        before = layer(x)
        layer.weight.copy_(torch.randn_like(layer.weight))  # a weight update copied in
        assert _close(layer(x), x, layer.weight, layer.bias)

        opt = torch.optim.SGD(layer.parameters(), lr=0.5)  # an optimizer step
        layer.weight.grad = torch.randn_like(layer.weight)
        layer.bias.grad = torch.zeros_like(layer.bias)
        opt.step()
        assert _close(layer(x), x, layer.weight, layer.bias)

        layer.weight.data = torch.randn(OUT, IN).to(dtype)  # storage swapped (zero-copy install)
        assert _close(layer(x), x, layer.weight, layer.bias)

        shared = torch.randn(OUT, IN).to(dtype)  # the weight a view of a buffer rewritten in place
        layer.weight.data = shared
        layer(x)
        shared.copy_(torch.randn(OUT, IN).to(dtype))  # moves neither storage nor version
        release(layer)
        after = layer(x)
    assert _close(after, x, shared, layer.bias)
    assert not torch.equal(after, before)


def _stack(dtype: torch.dtype, hidden: int = IN, kv: int = 128) -> tuple[Linear, ...]:
    """Attention-shaped projections of one input: the query's with a bias, the key's and value's
    (too small to prepack alone) without."""
    torch.manual_seed(2)
    return tuple(prepack(Linear(hidden, out, bias=out == hidden)).to(dtype) for out in (hidden, kv, kv))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 128, 300])
@pytest.mark.parametrize(("hidden", "kv"), [(IN, 128), (576, 192)])  # 576: SmolLM2's
def test_stacked_layers_each_get_their_own_prepacked_product(dtype, rows, hidden, kv):
    layers = _stack(dtype, hidden, kv)
    x = torch.randn(rows, hidden).to(dtype)
    with torch.no_grad():
        outs = stacked(layers, x)
        alone = [  # each weight blocked on its own, as a layer large enough to prepack runs
            torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(m.weight, 128), m.bias, "none", [], ""
            )
            for m in layers
        ]
    assert [o.shape for o in outs] == [(rows, hidden), (rows, kv), (rows, kv)]
    for out, layer, own in zip(outs, layers, alone, strict=True):
        bias = layer.bias if layer.bias is not None else torch.zeros(layer.out_features, dtype=dtype)
        assert _close(out, x, layer.weight, bias)
        assert torch.equal(out, own)  # stacking changes no bit
    assert layers[0]._stacked.entry is not None and all(m._blocked.entry is None for m in layers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_stacked_copy_follows_a_change_of_any_weight(dtype):
    query, key, value = layers = _stack(dtype)
    x = torch.randn(16, IN).to(dtype)
    with torch.no_grad():
        stacked(layers, x)
        key.weight.copy_(torch.randn_like(key.weight))  # an update copied into one of them
        assert _close(stacked(layers, x)[1], x, key.weight, torch.zeros(128, dtype=dtype))
        value.weight.data = torch.randn(128, IN).to(dtype)  # storage swapped
        assert _close(stacked(layers, x)[2], x, value.weight, torch.zeros(128, dtype=dtype))
        release(query)
        assert query._stacked.entry is None


def test_stacked_layers_run_alone_where_a_stack_is_not_prepacked():
    layers = _stack(torch.float32)
    x = torch.randn(8, IN, requires_grad=True)
    outs = stacked(layers, x)  # a gradient is needed: each layer's plain product
    sum(o.sum() for o in outs).backward()
    assert all(m.weight.grad is not None for m in layers) and layers[0]._stacked.entry is None
    small = tuple(prepack(Linear(64, 64)) for _ in range(3))  # 3 x 4,096 entries: under MIN_ELEMENTS
    with torch.no_grad():
        outs = stacked(small, torch.randn(8, 64))
    assert small[0]._stacked.entry is None and len(outs) == 3
    foreign = (*layers[:2], torch.nn.Linear(IN, 128))  # a layer in another's place (peft's LoRA layers)
    with torch.no_grad():
        outs = stacked(foreign, x.detach())
    assert torch.equal(outs[2], foreign[2](x.detach())) and layers[0]._stacked.entry is None


def test_prepacked_switches_on_for_the_block_only():
    layer = prepack(_layer(torch.float32), False)
    x = torch.randn(8, IN)
    with torch.no_grad():
        assert not layer.runs_prepacked(x)
        with prepacked(layer):
            assert layer.runs_prepacked(x)
            assert _close(layer(x), x, layer.weight, layer.bias)
            assert layer._blocked.entry is not None
        assert not layer.runs_prepacked(x)
        assert layer._blocked.entry is None  # the copy made inside is dropped
        prepack(layer)
        with prepacked(layer):
            pass
        assert layer.runs_prepacked(x)  # on before the block: stays on


def test_a_prepacked_model_copies_and_pickles_without_its_blocked_weights():
    cfg = CFG
    model = CausalLM(cfg)
    model.init_weights(0)
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        plain = model(ids)
        prepack(model)
        model(ids)  # the blocked copies now exist
        assert any(m._blocked.entry is not None for m in model.modules() if isinstance(m, Linear))
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert all(m._blocked.entry is None for m in twin.modules() if isinstance(m, Linear))
            assert torch.allclose(twin(ids), plain, atol=1e-5)


def test_the_engine_samples_from_weights_rewritten_in_their_buffer():
    """An update that rewrites the memory the engine's weights live in (no copy into them, no
    version bump): after ``set_version`` the engine scores with the new weights."""
    cfg = CFG
    model, other = CausalLM(cfg), CausalLM(cfg)
    model.init_weights(0)
    other.init_weights(1)
    engine = EmbeddedEngine(model)
    prompt = [int(t) for t in torch.randint(0, 512, (12,))]
    engine.score_batch([prompt])  # blocked copies of the version-0 weights
    for p in model.parameters():
        p.data = p.data.clone()  # each weight alone in a buffer we can rewrite
    engine.score_batch([prompt])
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.data.copy_(q)  # through .data: the parameter's version counter does not move
    engine.set_version(1)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = torch.log_softmax(other(ids)[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])
    assert torch.allclose(torch.tensor(engine.score_batch([prompt])[0]).double(), expected[:, 0], atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scoring_from_a_prepacked_head_gives_each_tokens_logprob(dtype, bias, temperature):
    """The trainer's scoring path (no gradient, no entropy): logits from the prepacked head, the
    log-normaliser in place, against log_softmax((h W^T + b) / T) in float64."""
    torch.manual_seed(1)
    head = prepack(Linear(IN, OUT, bias=bias)).to(dtype)
    h = torch.randn(40, IN).to(dtype)
    ids = torch.randint(0, OUT, (40,))
    with torch.no_grad():
        assert head.runs_prepacked(h)
        got = _picked(head, h, ids, temperature)
        logits = h.double() @ head.weight.double().T + (head.bias.double() if bias else 0.0)
    want = torch.log_softmax(logits / temperature, -1).gather(-1, ids[:, None])[:, 0]
    assert torch.allclose(got.double(), want, atol=1e-4 if dtype == torch.float32 else 0.05)


def test_threads_that_forward_at_once_after_a_weight_change_all_get_the_new_product():
    """An engine scores and decodes in two threads at once: after each weight change, forwards
    started together (one of them remaking the blocked copy) all return the new product."""
    layer = _layer(torch.float32)
    x = torch.randn(32, IN)
    results: list[torch.Tensor] = []
    for _ in range(5):
        with torch.no_grad():
            layer.weight.copy_(torch.randn_like(layer.weight))
        start = threading.Barrier(6)

        def forward(start=start):
            start.wait()
            with torch.no_grad():
                results.append(layer(x))

        threads = [threading.Thread(target=forward) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 6 and all(_close(r, x, layer.weight, layer.bias) for r in results)
        results.clear()
