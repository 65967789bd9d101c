"""Adapter-only updates: a receiver merges pushed adapters into its base weights, as float64 math
says, from the base every time (no drift over versions), for ``[out, in]`` and ``[in, out]`` weights."""

import pytest
import torch

from loong_transfermesh import LoraMerge, ShmReceiver, ShmSender, adapter_names

RANK, SCALE = 4, 2.0


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "attn.q.weight": torch.randn(24, 16, generator=g),  # [out, in]
        "mlp.c_fc.weight": torch.randn(16, 40, generator=g),  # [in, out], as GPT-2's Conv1D
        "norm.weight": torch.ones(16),
    }


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a_q, b_q = adapter_names("attn.q")
    a_fc, b_fc = adapter_names("mlp.c_fc")
    return {
        a_q: torch.randn(RANK, 16, generator=g),
        b_q: torch.randn(24, RANK, generator=g),
        a_fc: torch.randn(RANK, 16, generator=g),
        b_fc: torch.randn(40, RANK, generator=g),
    }


def _expected(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + s B A in float64, transposed for the [in, out] weight."""
    d = {k: v.double() for k, v in adapter.items()}
    q = base["attn.q.weight"].double() + SCALE * d["attn.q.lora_B.weight"] @ d["attn.q.lora_A.weight"]
    fc = (
        base["mlp.c_fc.weight"].double()
        + SCALE * (d["mlp.c_fc.lora_B.weight"] @ d["mlp.c_fc.lora_A.weight"]).T
    )
    return {"attn.q.weight": q, "mlp.c_fc.weight": fc}


def _merge(weights) -> LoraMerge:
    return LoraMerge(weights, ["attn.q", "mlp.c_fc"], RANK, SCALE, transposed={"mlp.c_fc"})


def test_pushed_adapters_merge_into_the_base_weights():
    base = _model()
    engine = {k: v.clone() for k, v in base.items()}
    merge = _merge(engine)
    assert set(merge.buffers) == set(_adapter(1))
    sender, receiver = ShmSender("lora-merge-test"), ShmReceiver("lora-merge-test")
    try:
        for version, seed in [(1, 1), (2, 2)]:
            sender.push(_adapter(seed), version)
            assert merge.apply(receiver, version) == version
            for name, want in _expected(base, _adapter(seed)).items():
                assert torch.allclose(engine[name].double(), want, rtol=0, atol=1e-5), name
        assert torch.equal(engine["norm.weight"], base["norm.weight"])  # not adapted, not touched
    finally:
        receiver.close()
        sender.close()
    fresh = {k: v.clone() for k, v in base.items()}
    _merge(fresh).load(_adapter(2))  # version 2 straight onto the base
    for name in base:
        assert torch.equal(engine[name], fresh[name]), name  # so versions leave no drift behind


def test_float32_adapters_merge_into_bfloat16_weights_rounded_once():
    """A bfloat16 engine taking a float32 trainer's adapters (``dtype=torch.float32``): the buffers
    are float32 (the manifest's dtype), each weight becomes ``W + s B A`` computed over its own
    base and rounded to bfloat16 once: within half a bfloat16 step of float64 math."""
    base = {k: v.to(torch.bfloat16) for k, v in _model().items()}
    engine = {k: v.clone() for k, v in base.items()}
    merge = LoraMerge(engine, ["attn.q", "mlp.c_fc"], RANK, SCALE, {"mlp.c_fc"}, dtype=torch.float32)
    assert {t.dtype for t in merge.buffers.values()} == {torch.float32}
    merge.load(_adapter(4))
    for name, want in _expected(base, _adapter(4)).items():
        got = engine[name]
        assert got.dtype == torch.bfloat16
        half_step = want.abs() * 2.0**-8 + 1e-30  # bfloat16 keeps 8 significant bits
        assert ((got.double() - want).abs() <= half_step).all(), name
    merge.load({k: torch.zeros_like(v) for k, v in merge.buffers.items()})
    for name in base:
        assert torch.equal(engine[name], base[name]), name  # no drift: the base is kept


def test_zero_adapters_give_the_base_back():
    base = _model()
    engine = {k: v.clone() for k, v in base.items()}
    merge = _merge(engine)
    merge.load(_adapter(3))
    assert not torch.equal(engine["attn.q.weight"], base["attn.q.weight"])
    merge.load({k: torch.zeros_like(v) for k, v in merge.buffers.items()})
    for name in base:
        assert torch.equal(engine[name], base[name]), name


def test_bad_adapters_are_refused_before_any_weight_changes():
    base = _model()
    engine = {k: v.clone() for k, v in base.items()}
    merge = _merge(engine)
    partial = dict(_adapter(1))
    del partial["attn.q.lora_A.weight"]
    with pytest.raises(ValueError, match=r"lacks \['attn.q.lora_A.weight'\]"):
        merge.load(partial)
    wrong = dict(_adapter(1), **{"attn.q.lora_B.weight": torch.zeros(24, RANK + 1)})
    with pytest.raises(ValueError, match=r"shapes differ for \['attn.q.lora_B.weight'\]"):
        merge.load(wrong)
    extra = dict(_adapter(1), **{"mlp.gate.lora_A.weight": torch.zeros(RANK, 8)})
    with pytest.raises(ValueError, match=r"has no place for \['mlp.gate.lora_A.weight'\]"):
        merge.load(extra)
    for name in base:
        assert torch.equal(engine[name], base[name]), name
    with pytest.raises(ValueError, match="'norm' has no 2-D weight"):
        LoraMerge(engine, ["norm"], RANK, SCALE)
    with pytest.raises(ValueError, match="'missing' has no 2-D weight"):
        LoraMerge(engine, ["missing"], RANK, SCALE)
