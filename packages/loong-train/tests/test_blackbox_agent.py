"""The recipe's black-box agent kind: ``openai``-SDK programs against the proxy a rollout worker hosts.

Exactness on the real policy (the tiny Qwen3, random init, char tokenizer): a multi-turn SDK
agent (streaming and not) and the shipped calc agent run through a RolloutWorker in blackbox
mode. Every episode is one row (its calls chain by token prefix) whose ids decode to the chat
template's rendering of the conversation the agent saw, whose model spans carry exactly the
logprobs the agent was sent and the engine's weight version, and whose logprobs equal a fresh
full forward pass at the recipe's temperature (the agent asked for another) within 2e-6 per token.
On a copy of the policy that memorized two demonstrations, the shipped agent calls the tool,
answers right, and its episode is token for token the white-box layout the policy learned.
A crashing program is one valid, untrainable ``failed`` row (never a silent 0). The rows of
one episode count once in GRPO statistics; a recipe asking for the shipped agent
without ``openai`` installed is refused with a message saying so. A short CPU training run of the
recipe in blackbox mode writes its run directory (slow).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from loong_agentflow import EpisodeLimits, EpisodeSpec, SandboxLimits
from loong_core.config import ConfigError
from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
from loong_core.telemetry import read_metrics
from loong_train.algo.losses import grpo_advantages, pack_batch
from loong_train.backends.torch_backend import token_logprobs
from loong_train.cli import main as cli
from loong_train.config import load_recipe
from loong_train.models.decoder import CausalLM
from loong_train.models.tokenizer import load_tokenizer
from loong_train.tiny import calc
from loong_train.tiny.calc_agent import run_tool
from loong_train.tiny.warmstart import sft_loss
from loong_train.workers.agent import BlackboxAgentConfig, WhiteboxAgentConfig, agent_program
from loong_train.workers.rollout import RolloutWorker

CHAT_AGENT = [sys.executable, str(Path(__file__).parent / "agents" / "chat_agent.py")]
SAMPLING = {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 12}
LIMITS = {"max_turns": 3, "max_model_tokens": 200, "timeout_s": 120.0}
TRAINABLE = (EpisodeStatus.OK, EpisodeStatus.TRUNCATED)


def _row(episode: str, row: int, reward: float, status: EpisodeStatus = EpisodeStatus.OK) -> Trajectory:
    spans = [TokenSpan([1], SpanSource.PROMPT), TokenSpan([2, 3], SpanSource.MODEL, [-0.1, -0.2], 0)]
    return Trajectory(
        sample_id=episode if row == 0 else f"{episode}#{row}",
        group_id="g",
        spans=spans,
        reward=reward,
        status=status,
        info={"episode": episode, "row": str(row)},
    )


def test_rows_of_one_episode_count_once_in_its_group():
    # episodes a (two rows, reward 1) and b (one row, 0): mean 0.5, population std 0.5 -> +-1 for
    # every row of each; c failed (two rows) has no say. Counting rows would give mean 2/3.
    rows = [
        _row("a", 0, 1.0),
        _row("a", 1, 1.0),
        _row("b", 0, 0.0),
        _row("c", 0, 1.0, EpisodeStatus.FAILED),
        _row("c", 1, 1.0, EpisodeStatus.FAILED),
    ]
    adv = grpo_advantages(rows, eps=0.0)
    assert adv == [1.0, 1.0, -1.0, 0.0, 0.0]
    batch = pack_batch(rows, adv, policy_version=0)
    assert batch.sample_ids == ["a", "a#1", "b"]
    assert batch.advantages == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, -1.0, -1.0]


def test_agent_type_defaults_to_whitebox_and_blackbox_needs_openai(monkeypatch, capsys):
    assert load_recipe("tiny-calc-agent").agent == WhiteboxAgentConfig()
    assert load_recipe("tiny-calc-agent", ["agent.type=blackbox"]).agent.type == "blackbox"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openai" else real(name, *a)
    )
    assert cli(["run", "tiny-calc-agent", "--set", "agent.type=blackbox"]) == 2  # before any warm start
    assert "needs openai, not installed" in capsys.readouterr().err
    own = load_recipe("tiny-calc-agent", ["agent.type=blackbox", 'agent.command=["./my-agent"]'])
    assert own.agent.command == ["./my-agent"]  # an agent of one's own needs no openai here


def test_agent_sandbox_keys(tmp_path, monkeypatch):
    """``[agent] sandbox``: true or a table of limits; settings it would make dead are refused."""
    blackbox = ["agent.type=blackbox"]
    assert load_recipe("tiny-calc-agent", blackbox).agent.sandbox_limits is None
    assert (
        load_recipe("tiny-calc-agent", [*blackbox, "agent.sandbox=true"]).agent.sandbox_limits
        == SandboxLimits()
    )
    table = load_recipe("tiny-calc-agent", [*blackbox, "agent.sandbox.memory_mb=512"]).agent
    assert table.sandbox_limits == SandboxLimits(memory_mb=512)
    for sets, named in [
        (["agent.sandbox.wall_s=5"], "rollout.episode_timeout_s"),
        (["agent.sandbox.wall_s=10"], "rollout.episode_timeout_s"),  # the default too: any setting
        (["agent.sandbox=true", 'agent.preload=["openai"]'], "agent.preload"),
        (["agent.sandbox.cpu_s=0"], "cpu_s"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_recipe("tiny-calc-agent", [*blackbox, *sets])
    with pytest.raises(ConfigError, match="sandbox"):  # the white-box agent has no such key
        load_recipe("tiny-calc-agent", ["agent.sandbox=true"])
    # a command's file arguments are made absolute: the episode runs in a fresh directory
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_agent.py").write_text("")
    agent = load_recipe(
        "tiny-calc-agent", [*blackbox, "agent.sandbox=true", 'agent.command=["python", "my_agent.py"]']
    )
    program = agent_program(agent.agent, None, EpisodeLimits(max_turns=2, max_model_tokens=64, timeout_s=9))
    assert program.argv == ["python", str(tmp_path / "my_agent.py")] and program.sandbox == SandboxLimits()


def test_calc_agent_tool_results_and_errors():
    assert run_tool("calc", '{"expr": "12*34"}') == "408"
    assert run_tool("calc", '{"expr": "2**8"}').startswith("error: ValueError: unsupported expression")
    assert run_tool("calc", '{"x": 1}').startswith("error: TypeError")
    assert run_tool("add", "{}") == "error: unknown tool 'add' (known: ['calc'])"


def _worker(tiny_dir: Path, command: list[str], max_new_tokens: int = 12, sandbox=False) -> RolloutWorker:
    agent = BlackboxAgentConfig(command=command, max_concurrency=4, sandbox=sandbox)
    sampling = {**SAMPLING, "max_new_tokens": max_new_tokens}
    return RolloutWorker(str(tiny_dir), seed=5, sampling=sampling, limits=LIMITS, agent=agent)


def _rollout(worker: RolloutWorker, specs: list[EpisodeSpec]) -> list[Trajectory]:
    worker.engine.set_version(7)
    try:
        return worker.rollout(specs).trajectories
    finally:
        worker.close()


def _worst_logprob_error(model: torch.nn.Module, row: Trajectory) -> float:
    """max |recorded - fresh| over the row's model tokens; fresh = one full forward at the recipe's T."""
    with torch.no_grad():
        fresh = token_logprobs(model, torch.tensor([row.token_ids]), SAMPLING["temperature"])[0].double()
    recorded = torch.tensor(row.logprobs, dtype=torch.float64)
    mask = torch.tensor(row.loss_mask, dtype=torch.bool)
    assert mask.sum() == row.num_model_tokens > 0
    return float((recorded - fresh)[mask].abs().max())


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_sdk_agent_episodes_are_token_exact_on_the_tiny_policy(kind, request, tmp_path):
    """With either tokenizer: the byte-level BPE's random-init samples include byte tokens that
    decode only together (or never, into U+FFFD), which the proxy must neither re-tokenize nor lose."""
    worker = _worker(request.getfixturevalue({"char": "tiny_dir", "bpe": "bpe_dir"}[kind]), CHAT_AGENT)
    tokenizer = worker.blackbox.proxy.renderer.tokenizer
    specs = [
        EpisodeSpec(
            f"e{i}",
            f"g{i // 2}",
            {**task, "turns": 3, "stream": i % 2 == 1, "transcript": str(tmp_path / f"e{i}.json")},
        )
        for i, task in enumerate(calc.eval_tasks(4))
    ]
    rows = _rollout(worker, specs)
    assert [t.sample_id for t in rows] == [s.sample_id for s in specs]  # one row each: the calls chained
    worst = 0.0
    for spec, row in zip(specs, rows, strict=True):
        assert row.status in TRAINABLE, row.info
        assert (row.info["calls"], row.info["rows"], row.info["episode"]) == ("3", "1", spec.sample_id)
        seen = json.loads(Path(spec.task["transcript"]).read_text())
        template = tokenizer.apply_chat_template(seen["messages"], tokenize=False)
        last_turn_end = "\n" if seen["finish"][-1] == "stop" else "<|im_end|>\n"  # cut turns get closed
        assert _decode(tokenizer, row.token_ids) + last_turn_end == template
        model_spans = [s for s in row.spans if s.is_model]
        assert [s.logprobs for s in model_spans] == seen["logprobs"]
        assert {s.weight_version for s in model_spans} == {7}
        worst = max(worst, _worst_logprob_error(worker.engine.model, row))
    print(f"black-box SDK agent: max |recorded - fresh forward| logprob = {worst:.2e}")
    assert worst <= 2e-6


@pytest.mark.integration
@pytest.mark.parametrize("sandbox", [False, True])
def test_shipped_calc_agent_episodes_are_token_exact_on_the_tiny_policy(tiny_dir, sandbox):
    """Also with ``[agent] sandbox = true``: each episode a fresh interpreter in the sandbox,
    reaching the worker's proxy through its own network namespace."""
    worker = _worker(tiny_dir, [], sandbox=sandbox)  # [] = python -m loong_train.tiny.calc_agent
    program = worker.blackbox.runner.program
    assert (program.sandbox is not None) == sandbox
    assert list(program.preload) == ([] if sandbox else ["openai", "loong_train.tiny.calc"])
    tokenizer = worker.blackbox.proxy.renderer.tokenizer
    tasks = calc.eval_tasks(4)
    rows = _rollout(worker, [EpisodeSpec(f"c{i}", "g", t) for i, t in enumerate(tasks)])
    assert [t.sample_id for t in rows] == ["c0", "c1", "c2", "c3"]
    worst = 0.0
    for task, row in zip(tasks, rows, strict=True):
        assert row.status in TRAINABLE, row.info  # the program ran, called the model and was scored
        prompt = tokenizer.apply_chat_template(task["messages"], add_generation_prompt=True, tokenize=False)
        assert row.spans[0].source == SpanSource.PROMPT
        assert _decode(tokenizer, row.spans[0].token_ids) == prompt
        worst = max(worst, _worst_logprob_error(worker.engine.model, row))
    print(f"shipped calc agent: max |recorded - fresh forward| logprob = {worst:.2e}")
    assert worst <= 2e-6


def _memorize(tiny_dir: Path, out: Path, tasks: list[dict], steps: int = 100) -> Path:
    """A copy of the tiny policy trained on these tasks' demonstrations until it repeats them."""
    shutil.copytree(tiny_dir, out)
    tokenizer, model = load_tokenizer(out), CausalLM.from_pretrained(out)
    rows = [_demonstration(tokenizer, t) for t in tasks]
    width = max(len(ids) for ids, _ in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width)
    for k, (i, m) in enumerate(rows):
        ids[k, : len(i)], mask[k, : len(m)] = torch.tensor(i), torch.tensor(m, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        sft_loss(model, ids, mask, 0.0).backward()
        opt.step()
    model.save_pretrained(out)
    return out


def _demonstration(tokenizer, task: dict) -> tuple[list[int], list[int]]:
    """The white-box agent's expert episode: token ids and loss mask."""
    ids, mask = [], []
    for text, is_model in calc.demonstration(task):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids, mask = ids + piece, mask + [int(is_model)] * len(piece)
    return ids, mask


@pytest.mark.integration
def test_shipped_calc_agent_on_a_policy_that_calls_the_tool(tiny_dir, tmp_path):
    # The black-box agent's successful episode is token for token the white-box layout the
    # policy learned from: prompt, tool call, tool response, answer (loss mask on model turns).
    tasks = calc.eval_tasks(2)
    worker = _worker(_memorize(tiny_dir, tmp_path / "memorized", tasks), [], max_new_tokens=64)
    tokenizer = worker.blackbox.proxy.renderer.tokenizer
    specs = [EpisodeSpec(f"m{i}", f"g{i % 2}", tasks[i % 2]) for i in range(4)]
    rows = _rollout(worker, specs)
    assert [t.sample_id for t in rows] == [s.sample_id for s in specs]
    solved = [(s, t) for s, t in zip(specs, rows, strict=True) if t.reward == 1.0]
    assert solved, [t.info for t in rows]
    for spec, row in solved:
        assert row.status == EpisodeStatus.OK and row.info["calls"] == "2"
        assert [s.source for s in row.spans] == [
            SpanSource.PROMPT,
            SpanSource.MODEL,
            SpanSource.TOOL,
            SpanSource.MODEL,
        ]
        assert (row.token_ids, row.loss_mask) == _demonstration(tokenizer, spec.task)
    worst = max(_worst_logprob_error(worker.engine.model, row) for row in rows)
    print(f"calc agent, {len(solved)}/4 solved: max |recorded - fresh forward| logprob = {worst:.2e}")
    assert worst <= 2e-6


@pytest.mark.integration
def test_a_crashing_agent_is_a_valid_failed_row_that_trains_nothing(tiny_dir):
    worker = _worker(tiny_dir, [sys.executable, "-c", "import sys; sys.exit(3)"])
    rows = _rollout(worker, [EpisodeSpec("f0", "g", calc.eval_tasks(1)[0])])
    (row,) = rows
    assert row.status == EpisodeStatus.FAILED and "exited with code 3" in row.info["error"]
    row.validate()  # what the pipeline checks when a rollout arrives; it never called the model
    assert row.oldest_version == -1 and row.num_model_tokens == 0
    assert pack_batch(rows, grpo_advantages(rows), policy_version=7).row_lens == []


SMALL = [
    "warmstart.steps=0",
    "train.steps=3",
    "train.batch_groups=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=12",
    "rollout.max_model_tokens=24",
    "eval.every=3",
    "eval.num_tasks=4",
    "agent.type=blackbox",
]


@pytest.mark.slow
@pytest.mark.integration
def test_blackbox_recipe_trains_and_writes_its_run_directory(tmp_path):
    out, sets = tmp_path / "run", [x for o in SMALL for x in ("--set", o)]
    assert cli(["run", "tiny-calc-agent", "--out", str(out), "--cache", str(tmp_path / "cache"), *sets]) == 0
    assert 'type = "blackbox"' in (out / "config.toml").read_text()
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert (row["samples"], row["failed"], row["timeouts"]) == (4, 0, 0)  # every program was scored
    assert rows[0]["mismatch_kl"] < 1e-9  # the proxy's recorded logprobs are the trainer's
    assert set(json.loads((out / "summary.json").read_text())["eval_reward_by_version"]) == {"0", "3"}
    assert (out / "checkpoints" / "final" / "model.safetensors").exists()
