"""Teacher scoring throughput and peak memory under a budget, against keeping every teacher
resident and against reloading teachers from disk for every batch, in the same run.

Setup: four local Qwen3-shaped teachers (hidden 768, 8 layers, vocabulary 32000, float32: 398 MB
each), written once with transformers. Workload: batches of 16 samples of 128 tokens (96 scored),
every batch mixing the four domains (4 samples each), one warm-up batch then 4 timed ones. Cases
(``extra_info["case"]``), each in its own child process (one torch thread) so that its peak RSS
(``VmHWM``) is its own:

- ``managed``: ``TeacherManager`` with ``budget_bytes`` = 1.5 teachers (one resident at a time).
- ``all_resident``: ``TeacherManager`` without a budget: all four stay resident (the floor for time).
- ``reload_each_batch``: per batch and teacher, ``AutoModelForCausalLM.from_pretrained`` from the
  checkpoint directory (what code without a manager does), scored by the same scoring function, dropped.

``extra_info``: ``case``, ``tokens`` (scored, timed batches), ``tokens_per_s`` (timed batches only),
``peak_rss_bytes``, ``base_rss_bytes`` (RSS after imports, before any teacher), ``teacher_bytes``,
``bytes_paged_in``; ``test_ratios`` prints each case and the managed case's ratios to each baseline.
Run: ``uv run pytest packages/loong-teacher/benchmarks --benchmark-enable --dist no -q``.
With benchmarks disabled (the default test run) the cases run in process on tiny teachers, as a
smoke test of the harness.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

FULL = {"hidden": 768, "layers": 8, "vocab": 32000, "batches": 5, "samples": 16, "seq": 128, "prompt": 32}
SMOKE = {"hidden": 64, "layers": 2, "vocab": 256, "batches": 2, "samples": 8, "seq": 24, "prompt": 8}
DOMAINS = ["math", "code", "chat", "science"]
CASES = ["managed", "all_resident", "reload_each_batch"]


def _write_teachers(root: Path, spec: dict) -> list[str]:
    import transformers

    paths = []
    for i, name in enumerate(DOMAINS):
        config = transformers.Qwen3Config(
            vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["hidden"] * 8 // 3,
            num_hidden_layers=spec["layers"], num_attention_heads=12 if spec["hidden"] % 12 == 0 else 4,
            num_key_value_heads=4, head_dim=64 if spec["hidden"] >= 512 else 16, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(i)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        paths.append(str(root / name))
    return paths


def _workload(spec: dict) -> list[list]:
    from loong_teacher import ScoreRequest

    rng = random.Random(0)
    scored = [0] * spec["prompt"] + [1] * (spec["seq"] - spec["prompt"])
    batches = []
    for _ in range(spec["batches"]):
        domains = [DOMAINS[i % len(DOMAINS)] for i in range(spec["samples"])]
        rng.shuffle(domains)
        batches.append([
            ScoreRequest(token_ids=[rng.randrange(spec["vocab"]) for _ in range(spec["seq"])], loss_mask=scored,
                         tags={"domain": d})
            for d in domains
        ])  # fmt: skip
    return batches


def _rss(field: str) -> int:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of this process, in bytes. Not ``ru_maxrss``: Linux keeps
    that across ``execve``, so a child forked from a large pytest process would report the parent's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_case(case: str, paths: list[str], spec: dict) -> dict:
    """Run one case in this process; returns what ``extra_info`` records."""
    import transformers  # noqa: F401  (every case needs it; its import is not teacher memory)

    from loong_teacher import LocalTeacher, LocalTeacherConfig, TeacherManager, TeacherManagerConfig

    torch.set_num_threads(1)
    base = _rss("VmRSS")
    batches = _workload(spec)
    teachers = [LocalTeacherConfig(name=d, path=p, tags=[d]) for d, p in zip(DOMAINS, paths, strict=True)]
    manager = None
    if case == "reload_each_batch":
        step = _reloading(dict(zip(DOMAINS, paths, strict=True)))
    else:
        budget = int(1.5 * max(LocalTeacher(t).nbytes for t in teachers)) if case == "managed" else None
        manager = TeacherManager(TeacherManagerConfig(teachers=teachers, budget_bytes=budget))
        step = manager.score
    step(batches[0])  # warm-up: not timed
    paged = manager.residency.paged_in if manager else 0
    t0 = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    seconds = time.perf_counter() - t0
    tokens = sum(sum(s.loss_mask) for b in batches[1:] for s in b)
    return {
        "case": case, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "peak_rss_bytes": _rss("VmHWM"), "base_rss_bytes": base, "teachers": len(paths),
        "teacher_bytes": os.path.getsize(Path(paths[0]) / "model.safetensors"),
        "bytes_paged_in": (manager.residency.paged_in - paged) if manager else None,
    }  # fmt: skip


def _reloading(paths: dict[str, str]):
    """Score a batch loading each needed teacher from its checkpoint, then dropping it."""
    import transformers

    from loong_teacher.local import score_rows

    def step(batch) -> None:
        groups: dict[str, list] = {}
        for s in batch:
            groups.setdefault(s.tags["domain"], []).append(s)
        for domain, samples in groups.items():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                paths[domain], dtype=torch.float32
            ).eval()
            rows = [(s.token_ids, [t for t, m in enumerate(s.loss_mask) if m]) for s in samples]
            score_rows(model, rows, 0, 8192, torch.device("cpu"))
            del model

    return step


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory) -> tuple[list[str], dict, bool]:
    # the root config passes --benchmark-disable; --benchmark-enable on the command line wins
    disabled = request.config.getoption("benchmark_disable") and not request.config.getoption(
        "benchmark_enable"
    )
    spec = SMOKE if disabled else FULL
    torch.set_num_threads(1)
    return _write_teachers(tmp_path_factory.mktemp("bench-teachers"), spec), spec, disabled


def _in_child(case: str, paths: list[str], spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    # A fixed glibc mmap threshold (every case alike): freed activations go back to the OS, so RSS
    # shows live memory rather than heap the allocator kept after raising its dynamic threshold.
    env["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    out = subprocess.run(
        [sys.executable, __file__, case, json.dumps(paths), json.dumps(spec)],
        capture_output=True, text=True, env=env, check=False, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_teacher_scoring(benchmark, setup, case):
    paths, spec, disabled = setup
    result: dict = {}

    def run() -> None:
        result.update(run_case(case, paths, spec) if disabled else _in_child(case, paths, spec))

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(result, rss_measured_in="this process" if disabled else "child process")
    assert result["tokens"] > 0
    RESULTS[case] = result


RESULTS: dict[str, dict] = {}  # case -> its result, filled by test_teacher_scoring


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """The managed case against each baseline: throughput and peak RSS (whole process and above
    the libraries' base)."""
    m, a, r = (results[c] for c in CASES)

    def above(x: dict) -> int:
        return x["peak_rss_bytes"] - x["base_rss_bytes"]

    return {
        "throughput managed / all_resident": m["tokens_per_s"] / a["tokens_per_s"],
        "throughput managed / reload_each_batch": m["tokens_per_s"] / r["tokens_per_s"],
        "peak RSS managed / all_resident": m["peak_rss_bytes"] / a["peak_rss_bytes"],
        "peak RSS above base managed / all_resident": above(m) / above(a),
    }


def test_ratios(setup, capsys):
    """Runs after the three cases (in this module's order): prints every case and the ratios."""
    if set(RESULTS) != set(CASES):
        pytest.skip("needs all three cases in this run")
    with capsys.disabled():
        print()
        for case, x in RESULTS.items():
            print(
                f"{case}: {x['tokens_per_s']:.1f} tokens/s, peak RSS {x['peak_rss_bytes'] / 1e9:.3f} GB "
                f"(base {x['base_rss_bytes'] / 1e9:.3f} GB), paged in {x['bytes_paged_in']}"
            )
        for name, value in ratios(RESULTS).items():
            print(f"{name}: {value:.2f}")
    assert all(v > 0 for v in ratios(RESULTS).values())


def page_in_seconds(path: str, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` seconds to make one teacher resident: ``mapped`` (the CPU path of a
    teacher stored in its dtype), ``copied`` (the path of other dtypes: a chunked copy from the
    mapped file into a flat buffer already allocated, as the manager reuses one) and the floor,
    ``memcpy``: as many bytes copied between two buffers already in memory (what a copy costs
    at best; mapping copies nothing and can beat it)."""
    from loong_teacher import LocalTeacher, LocalTeacherConfig
    from loong_teacher.local import _copy_from_files

    teacher = LocalTeacher(LocalTeacherConfig(name="t", path=path))
    size = max(s.offset + s.nbytes for s in teacher._slots)
    flat, src = torch.zeros(size, dtype=torch.uint8), torch.ones(size, dtype=torch.uint8)

    def mapped() -> None:
        teacher.page_in()
        teacher.page_out()  # the mapping goes with the parameters' views

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    return {
        "mapped": best(mapped),
        "copied": best(lambda: _copy_from_files(teacher._slots, flat)),
        "memcpy": best(lambda: flat.copy_(src)),
        "bytes": size,
    }


def test_page_in(setup, capsys):
    """One teacher's page-in, mapped vs copied vs a plain memcpy of its bytes (this process)."""
    paths, _, _ = setup
    seconds = page_in_seconds(paths[0])
    with capsys.disabled():
        print(
            f"\npage in {seconds['bytes'] / 1e6:.0f} MB: mapped {seconds['mapped'] * 1e3:.1f} ms, "
            f"copied {seconds['copied'] * 1e3:.1f} ms, memcpy {seconds['memcpy'] * 1e3:.1f} ms"
        )
    assert all(v > 0 for v in seconds.values())


def test_switch_cost(setup, capsys):
    """What a teacher switch costs the managed path, per teacher (this process): page-in, the
    first score on a fresh mapping, a second score, page-out; against the same score with every
    teacher resident."""
    from loong_teacher import LocalTeacher, LocalTeacherConfig

    paths, spec, _ = setup
    rows = [(s.token_ids, [t for t, m in enumerate(s.loss_mask) if m]) for s in _workload(spec)[0][:4]]
    teachers = [LocalTeacher(LocalTeacherConfig(name=d, path=p)) for d, p in zip(DOMAINS, paths, strict=True)]

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for t in teachers:
        t.page_in()
    resident = [timed(lambda t=t: t.score(rows)) for t in teachers for _ in range(2)]
    for t in teachers:
        t.page_out()
    switches = [
        (
            timed(t.page_in),
            timed(lambda t=t: t.score(rows)),
            timed(lambda t=t: t.score(rows)),
            timed(t.page_out),
        )
        for _ in range(2)
        for t in teachers
    ]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    with capsys.disabled():
        print(
            f"\nswitch: page in {mean([s[0] for s in switches]) * 1e3:.1f} ms, first score "
            f"{mean([s[1] for s in switches]):.3f} s, second {mean([s[2] for s in switches]):.3f} s, "
            f"page out {mean([s[3] for s in switches]) * 1e3:.1f} ms; resident score {mean(resident):.3f} s"
        )
    assert all(v > 0 for s in switches for v in s)


if __name__ == "__main__":
    print(json.dumps(run_case(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
