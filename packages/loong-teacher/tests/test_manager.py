"""TeacherManager on tiny local Qwen3 checkpoints built here with transformers (no downloads).

References: a fresh, independent transformers model loaded from the same directory, run in float64;
memory is checked both in the manager's accounting and by measuring the parameters actually held.
"""

from __future__ import annotations

import mmap
import random
from pathlib import Path

import msgspec
import pytest
import torch

from loong_core.config import ConfigError, load_config
from loong_core.records import SpanSource, TokenSpan, Trajectory
from loong_teacher import (
    LocalTeacher,
    LocalTeacherConfig,
    ScoreRequest,
    SGLangTeacherConfig,
    TeacherBudgetError,
    TeacherManager,
    TeacherManagerConfig,
    TeacherRoutingError,
    TokenizerMapping,
)

transformers = pytest.importorskip("transformers")

VOCAB = 64
SIZES = {"math": (32, 2), "code": (32, 1), "chat": (48, 2)}  # hidden, layers


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _save(path, hidden: int, layers: int, seed: int, tie: bool = False, dtype=torch.float32) -> str:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # sharper than the default init, so teachers disagree visibly
    model.to(dtype).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("teachers")
    out = {name: _save(root / name, h, n, seed) for seed, (name, (h, n)) in enumerate(SIZES.items())}
    out["tied"] = _save(root / "tied", 32, 2, 7, tie=True)
    out["half"] = _save(root / "half", 32, 2, 8, dtype=torch.float16)  # float32 teacher: copied, cast
    return out


def _config(
    ckpts, budget=None, top_k=0, default="chat", names=("math", "code", "chat")
) -> TeacherManagerConfig:
    teachers = [
        LocalTeacherConfig(name=n, path=ckpts[n], tags=[n], coefficient=0.5 + i) for i, n in enumerate(names)
    ]
    return TeacherManagerConfig(teachers=teachers, default=default, budget_bytes=budget, top_k=top_k)


def _sample(rng: random.Random, domain: str | None, n: int = 10, prompt: int = 4) -> ScoreRequest:
    ids = [rng.randrange(VOCAB) for _ in range(n)]
    return ScoreRequest(
        token_ids=ids, loss_mask=[0] * prompt + [1] * (n - prompt), tags={"domain": domain} if domain else {}
    )


def _reference(path: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of an independent transformers model in float64: row t predicts ids[t + 1]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)


def _sizes(ckpts) -> dict[str, int]:
    return {n: LocalTeacher(LocalTeacherConfig(name=n, path=ckpts[n])).nbytes for n in SIZES}


@pytest.mark.parametrize(("name", "rows"), [("math", 256), ("tied", 256), ("half", 256), ("math", 4)])
def test_logprobs_and_topk_equal_an_independent_forward_pass(ckpts, name, rows, monkeypatch):
    """Mapped teachers (float32 files) and a copied one (float16 file, float32 teacher) alike;
    ``rows``: positions log-softmaxed at a time (4: each batch in several chunks)."""
    monkeypatch.setattr("loong_teacher.local._ROWS", rows)
    rng = random.Random(0)
    samples = [_sample(rng, None, n) for n in (12, 7, 9)]
    config = TeacherManagerConfig(
        teachers=[LocalTeacherConfig(name=name, path=ckpts[name])], default=name, top_k=5
    )
    manager = TeacherManager(config)
    assert manager.teachers[name].mapped is (name != "half")
    scores = manager.score(samples)
    assert scores.logprobs.shape == (3, 12) and scores.topk_ids.shape == (3, 12, 5)
    for b, s in enumerate(samples):
        ref = _reference(ckpts[name], s.token_ids)
        pos = torch.tensor([t for t, m in enumerate(s.loss_mask) if m])
        want = ref[pos - 1].gather(-1, torch.tensor(s.token_ids)[pos][:, None]).squeeze(-1)
        torch.testing.assert_close(scores.logprobs[b, pos].double(), want, rtol=0, atol=2e-5)
        top_lp, top_ids = ref[pos - 1].topk(5, dim=-1)
        assert torch.equal(scores.topk_ids[b, pos], top_ids)
        torch.testing.assert_close(scores.topk_logprobs[b, pos].double(), top_lp, rtol=0, atol=2e-5)
        tail = ref[pos - 1].scatter(-1, top_ids, -torch.inf).logsumexp(-1)
        torch.testing.assert_close(scores.tail_logprobs[b, pos].double(), tail, rtol=0, atol=2e-5)
        unscored = scores.mask[b] == 0
        assert (scores.logprobs[b][unscored] == 0).all()


def test_routing_by_tag_with_default(ckpts):
    rng = random.Random(1)
    manager = TeacherManager(_config(ckpts))
    samples = [_sample(rng, d) for d in ("math", "code", "poetry", None, "math")]
    scores = manager.score(samples)
    assert scores.teacher == ["math", "code", "chat", "chat", "math"]
    assert scores.coef.flatten().tolist() == [0.5, 1.5, 2.5, 2.5, 0.5]
    assert scores.metrics["teacher/math/samples"] == 2 and scores.metrics["teacher/chat/samples"] == 2
    assert scores.metrics["teacher/code/tokens"] == 6
    code_alone = TeacherManager(_config(ckpts, names=("code",), default="code")).score([samples[1]])
    assert torch.equal(scores.logprobs[1], code_alone.logprobs[0])
    strict = TeacherManager(_config(ckpts, default=""))
    with pytest.raises(TeacherRoutingError, match="domain='poetry'"):
        strict.score([samples[2]])


def test_each_teacher_is_made_resident_once_per_batch(ckpts):
    rng = random.Random(2)
    sizes = _sizes(ckpts)
    manager = TeacherManager(_config(ckpts, budget=max(sizes.values())))  # one teacher at a time
    batch = [_sample(rng, d) for d in ["math", "code", "chat"] * 4]  # interleaved
    first = manager.score(batch)
    assert [first.metrics[f"teacher/{n}/loads"] for n in SIZES] == [1, 1, 1]
    resident = manager.residency.resident()
    assert len(resident) == 1
    second = manager.score(batch)  # the resident teacher goes first and is not loaded again
    assert second.metrics[f"teacher/{resident[0]}/loads"] == 0 and second.metrics["teacher/loads"] == 2
    assert torch.equal(first.logprobs, second.logprobs)


def test_least_recently_used_teacher_is_evicted(ckpts):
    rng = random.Random(3)
    sizes = _sizes(ckpts)
    manager = TeacherManager(_config(ckpts, budget=sizes["math"] + sizes["chat"]))
    for domain in ("math", "code", "math", "chat"):
        manager.score([_sample(rng, domain)])
    assert manager.residency.resident() == ["math", "chat"]  # code was least recently used
    assert manager.residency.evictions == 1


def test_budget_smaller_than_the_largest_teacher_is_a_configuration_error(ckpts):
    sizes = _sizes(ckpts)
    with pytest.raises(TeacherBudgetError) as err:
        TeacherManager(_config(ckpts, budget=sizes["chat"] - 1))
    assert str(sizes["chat"] - 1) in str(err.value) and str(sizes["chat"]) in str(err.value)
    assert "'chat'" in str(err.value)


def _held_bytes(manager: TeacherManager) -> int:
    """Bytes of real (non-meta) parameter storage the teachers' modules hold, measured, plus the
    freed buffers the manager keeps for reuse."""
    storages = {}
    for teacher in manager.teachers.values():
        for p in teacher.model.parameters():
            if not p.is_meta:
                storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(storages.values()) + sum(b.untyped_storage().nbytes() for b in manager.residency.free)


def test_peak_resident_bytes_never_exceed_the_budget(ckpts, monkeypatch):
    sizes = _sizes(ckpts)
    budget = sizes["chat"] + sizes["code"] + 100  # two teachers, never all three
    manager = TeacherManager(_config(ckpts, budget=budget))
    held = []
    page_in = LocalTeacher.page_in

    def measured(self, storage=None):
        n = page_in(self, storage)
        held.append(_held_bytes(manager))
        return n

    monkeypatch.setattr(LocalTeacher, "page_in", measured)
    rng = random.Random(4)
    for _ in range(12):
        manager.score([_sample(rng, rng.choice(list(SIZES))) for _ in range(rng.randrange(1, 5))])
        assert manager.residency.reserved <= budget
    assert len(held) > 5 and max(held) <= budget
    assert manager.residency.peak <= budget and manager.last_metrics["teacher/peak_resident_bytes"] <= budget


def test_bytes_paged_in_is_reported_per_call(ckpts):
    rng = random.Random(5)
    sizes = _sizes(ckpts)
    manager = TeacherManager(_config(ckpts))  # no budget: everything stays resident
    m1 = manager.score([_sample(rng, "math"), _sample(rng, "code")]).metrics
    assert m1["teacher/bytes_paged_in"] == sizes["math"] + sizes["code"]
    m2 = manager.score([_sample(rng, "math"), _sample(rng, "chat")]).metrics
    assert m2["teacher/bytes_paged_in"] == sizes["chat"] and m2["teacher/math/loads"] == 0
    assert m2["teacher/resident_bytes"] == sum(sizes.values())


def test_trajectories_score_as_they_are(ckpts):
    prompt = TokenSpan(token_ids=[1, 2, 3], source=SpanSource.PROMPT)
    model = TokenSpan(token_ids=[4, 5], logprobs=[-1.0, -1.0], source=SpanSource.MODEL, weight_version=0)
    tool = TokenSpan(token_ids=[6], source=SpanSource.TOOL)
    traj = Trajectory(
        sample_id="s", group_id="g", spans=[prompt, model, tool, model], tags={"domain": "code"}
    )
    scores = TeacherManager(_config(ckpts)).score([traj])
    assert scores.mask[0].tolist() == [0, 0, 0, 1, 1, 0, 1, 1] and scores.teacher == ["code"]
    assert (scores.logprobs[0] < 0).sum() == 4


def test_tokenizer_mapping_translates_ids_both_ways(ckpts):
    rng = random.Random(6)
    sample = _sample(rng, "math")
    swap = TokenizerMapping(token_ids=[[sample.token_ids[5], 63], [sample.token_ids[7], 62]])
    teacher_ids = swap.teacher_ids(sample.token_ids)
    mapped = TeacherManagerConfig(
        teachers=[LocalTeacherConfig(name="math", path=ckpts["math"], tokenizer_mapping=swap)],
        default="math",
        top_k=64,
    )
    plain = TeacherManagerConfig(
        teachers=[LocalTeacherConfig(name="math", path=ckpts["math"])], default="math", top_k=64
    )
    got = TeacherManager(mapped).score([sample])
    want = TeacherManager(plain).score([msgspec.structs.replace(sample, token_ids=teacher_ids)])
    assert torch.equal(got.logprobs, want.logprobs)
    back = {63: sample.token_ids[5], 62: sample.token_ids[7]}
    assert torch.equal(got.topk_ids, want.topk_ids.clone().apply_(lambda i: back.get(i, i)))


def test_config_from_toml_picks_the_backend_by_type(ckpts, tmp_path):
    toml = tmp_path / "teachers.toml"
    toml.write_text(
        f'default = "math"\nbudget_bytes = 1_000_000\ntop_k = 4\n'
        f'[[teachers]]\nname = "math"\ntype = "local"\npath = "{ckpts["math"]}"\ntags = ["math"]\n'
        f'[[teachers]]\nname = "remote"\ntype = "sglang"\nurl = "http://127.0.0.1:30000"\ntags = ["code"]\n'
        f"[teachers.tokenizer_mapping]\naccept = ['chat_template']\n"
    )
    config = load_config(toml, TeacherManagerConfig)
    assert isinstance(config.teachers[0], LocalTeacherConfig) and isinstance(
        config.teachers[1], SGLangTeacherConfig
    )
    assert config.teachers[1].tokenizer_mapping == TokenizerMapping(accept=frozenset({"chat_template"}))
    bad = {"teachers": [{"name": "a", "type": "local", "url": "http://x"}]}
    with pytest.raises(
        ConfigError, match=r"unknown config key 'teachers\[0\]\.url' \(type 'sglang' has it, this is 'local'"
    ):
        load_config(bad, TeacherManagerConfig)
    with pytest.raises(
        ConfigError,
        match=r"'teachers\[0\]\.type': invalid value 'remote' \(expected one of: 'local', 'sglang'\)",
    ):
        load_config({"teachers": [{"name": "a", "type": "remote", "url": "http://x"}]}, TeacherManagerConfig)
    with pytest.raises(ValueError, match="routed to both"):
        TeacherManagerConfig(
            teachers=[
                LocalTeacherConfig(name="a", path="x", tags=["t"]),
                LocalTeacherConfig(name="b", path="y", tags=["t"]),
            ]
        )


def test_samples_without_scored_tokens_load_nothing(ckpts):
    manager = TeacherManager(_config(ckpts))
    scores = manager.score([ScoreRequest(token_ids=[1, 2, 3], loss_mask=[0, 0, 0], tags={"domain": "math"})])
    assert scores.metrics["teacher/loads"] == 0 and scores.logprobs.abs().sum() == 0


@pytest.mark.gpu
def test_gpu_teacher_pages_in_from_pinned_memory(ckpts):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = random.Random(7)
    samples = [_sample(rng, "math") for _ in range(3)]
    cpu = TeacherManager(_config(ckpts, names=("math",), default="math")).score(samples)
    gpu_cfg = TeacherManagerConfig(
        teachers=[LocalTeacherConfig(name="math", path=ckpts["math"], device="cuda")], default="math"
    )
    manager = TeacherManager(gpu_cfg)
    gpu = manager.score(samples)
    torch.testing.assert_close(gpu.logprobs, cpu.logprobs, rtol=0, atol=1e-4)
    assert manager.residency.free == [] and manager.teachers["math"].storage.is_cuda


def _mappings(path: str) -> list[dict[str, int]]:
    """This process's mappings of files under ``path`` (``/proc/self/smaps``): each one's address
    range and its ``Rss`` and ``Anonymous`` kB (anonymous: pages copied out of the file)."""
    out, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
            current = None
            if len(fields) == 6 and fields[5].startswith(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                current = {"lo": lo, "hi": hi}
                out.append(current)
        elif current is not None and fields[0] in ("Rss:", "Anonymous:"):
            current[fields[0][:-1].lower()] = int(fields[1])
    return out


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux /proc/self/smaps")
def test_a_mapped_teacher_scores_from_its_file_without_a_copy(ckpts):
    """Every parameter of a resident float32 teacher lies inside the checkpoint file's mapping,
    whose pages are all present and none copied (no anonymous memory: a writable private
    mapping populated at once would copy every page), also after scoring; once paged out, the
    file is no longer mapped."""
    cfg = LocalTeacherConfig(name="math", path=ckpts["math"])
    teacher = LocalTeacher(cfg)
    file = Path(ckpts["math"]) / "model.safetensors"
    assert teacher.mapped and _mappings(ckpts["math"]) == []
    assert teacher.page_in() == teacher.nbytes == file.stat().st_size
    (mapping,) = _mappings(ckpts["math"])
    assert mapping["rss"] * 1024 >= file.stat().st_size - mmap.PAGESIZE and mapping["anonymous"] == 0
    assert all(mapping["lo"] <= p.data_ptr() < mapping["hi"] for p in teacher.model.parameters())
    assert all(p.data_ptr() + p.nbytes <= mapping["hi"] for p in teacher.model.parameters())
    teacher.score([([1, 5, 9, 12, 3], [2, 3, 4])])
    assert _mappings(ckpts["math"])[0]["anonymous"] == 0
    (empty,) = teacher.score([([1, 5, 9], [])], top_k=2)  # a row with nothing to score
    assert empty.logprobs.shape == (0,) and empty.topk_ids.shape == (0, 2)
    assert teacher.page_out() is None
    assert _mappings(ckpts["math"]) == []  # nothing else held a view: no garbage collection needed
