"""Build the tiny model and tokenizer, then warm-start it with supervised demonstrations.

RL on a model this small needs a policy whose *sampled* episodes sometimes succeed, so GRPO
groups carry signal. The warm start trains on expert episodes (loss on model tokens only, laid
out exactly as the agent's token buffer lays them out) and stops at the first evaluation whose
sampled (rollout temperature) success reaches the target. Everything is deterministic given the seed.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import logging
from pathlib import Path

import msgspec
import torch
from tqdm import tqdm

from loong_agentflow import ChatML, EpisodeLimits, EpisodeSpec, ToolAgent, run_episodes
from loong_core.protocols import SamplingParams
from loong_core.records import Trajectory
from loong_train.config import Recipe
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.models.decoder import CausalLM, DecoderConfig
from loong_train.models.prepack import prepack
from loong_train.models.source import resolve
from loong_train.models.tokenizer import HFCodec, load_tokenizer
from loong_train.tasks import Task, TaskTables, build_task
from loong_train.tasks.reward import final_turn, score_groups
from loong_train.tiny.tokenizer import build_tokenizer

__all__ = ["build_tiny", "prepare_model", "probe_episodes", "sampled_success", "tokenizer_corpus"]

log = logging.getLogger("loong.warmstart")


def build_tiny(path: Path, recipe: Recipe) -> Path:
    """A random-init tiny Qwen3 + the recipe's local tokenizer, saved as a Hugging Face directory."""
    m = recipe.model
    corpus = tokenizer_corpus(recipe) if m.tokenizer != "char" else []
    build_tokenizer(path, m.tokenizer, corpus, m.bpe_vocab_size)
    vocab = len(load_tokenizer(path))
    sizes = msgspec.structs.asdict(m)
    for key in ("path", "trust_remote_code", "tokenizer", "bpe_vocab_size"):
        del sizes[key]
    model = CausalLM(DecoderConfig(vocab_size=vocab, **sizes))
    model.init_weights(recipe.seed)
    model.save_pretrained(path)
    return path


def tokenizer_corpus(recipe: Recipe, n: int = 2000) -> list[str]:
    """The text a BPE tokenizer for ``recipe`` is trained on: ``n`` training items of its task as
    the model will see them (the demonstration's transcript; the prompt for a task without one)."""
    task = build_task(recipe.task, recipe.task_tables)
    items = itertools.islice(task.train_stream(recipe.seed + 3, task.held_out(recipe.eval.num_tasks)), n)
    if task.demonstrates:
        return ["".join(text for text, _ in task.demonstration(item)) for item in items]
    return [ChatML.prompt(item["messages"]) for item in items]


def sampled_success(
    model: CausalLM, tokenizer, recipe: Recipe, tasks: list[dict], seed: int, task: Task | None = None
) -> float:
    """Mean reward of one temperature-``T`` episode per task (held-out or probe tasks) of the
    recipe's ``task`` (built from the recipe when not given)."""
    rewards = [t.reward for t in probe_episodes(model, tokenizer, recipe, tasks, seed, task)]
    return sum(rewards) / len(rewards)


def _by_domain(tasks: list[dict], rewards: list[float]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for t, r in zip(tasks, rewards, strict=True):
        groups.setdefault(t.get("tags", {}).get("domain", ""), []).append(r)
    return {d: sum(rs) / len(rs) for d, rs in sorted(groups.items())}


def probe_episodes(
    model: CausalLM, tokenizer, recipe: Recipe, tasks: list[dict], seed: int, task: Task | None = None
) -> list[Trajectory]:
    """One temperature-``T`` episode per task from ``model`` (the recipe's rollout settings),
    rewarded as in a run (group rewards over groups of one)."""
    engine = EmbeddedEngine(model, seed=seed, pad_id=tokenizer.pad_token_id)
    r = recipe.rollout
    sampling = SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    specs = [EpisodeSpec(f"probe-{i}", f"probe-{i}", t) for i, t in enumerate(tasks)]
    limits = EpisodeLimits(max_turns=r.max_turns, max_model_tokens=r.max_model_tokens)
    task = task or build_task(recipe.task, recipe.task_tables)
    agent = task.agent() or ToolAgent(task.tools(), task.reward)
    codec = HFCodec(tokenizer)
    trajs = asyncio.run(run_episodes(agent, specs, engine, codec, sampling, limits))
    if (group := task.group_reward) is not None:  # each probe episode is a group of one
        text = functools.partial(final_turn, decode=codec.decode, strip_end=ChatML.strip_end)
        score_groups(group, trajs, {s.sample_id: s.task for s in specs}, text)
    prepack(model, False)  # the engine prepacked the model it borrowed; training goes on with it
    model.train()
    return trajs


def _sft_batch(codec: HFCodec, task: Task, items: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for item in items:
        ids, mask = [], []
        for text, is_model in task.demonstration(item):
            piece = codec.encode(text)
            ids += piece
            mask += [int(is_model)] * len(piece)
        rows.append((ids, mask))
    width = max(len(i) for i, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for k, (i, m) in enumerate(rows):
        ids[k, : len(i)] = torch.tensor(i)
        mask[k, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def sft_loss(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Mean over masked tokens of (1 - s) * NLL(target) + s * mean_v(-log p(v)); ids, mask [rows, seq]."""
    logp = torch.log_softmax(model(ids)[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    per_token = (1 - smoothing) * nll + smoothing * -logp.mean(-1)
    m = mask[:, 1:]
    return (per_token * m).sum() / m.sum()


def warm_start(path: Path, recipe: Recipe) -> dict:
    """Supervised steps until sampled success reaches the target; saves the model in place."""
    w = recipe.warmstart
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(w.threads or recipe.threads)
    tokenizer = load_tokenizer(path)
    codec, model = HFCodec(tokenizer), CausalLM.from_pretrained(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, w.warmup_steps)))
    task = _demonstrated(recipe)
    held_out = task.held_out(recipe.eval.num_tasks)
    probe = task.probe(w.eval_tasks, recipe.seed + 7, held_out)  # a probe set, not the held-out eval
    stream = task.train_stream(recipe.seed + 1, held_out)
    success, domains, step = 0.0, {}, 0
    bar = tqdm(range(1, w.steps + 1), desc="warm start", unit="step", leave=False)
    for step in bar:
        ids, mask = _sft_batch(codec, task, [next(stream) for _ in range(w.batch_size)])
        loss = sft_loss(model, ids, mask, w.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % w.eval_every == 0:
            rewards = [t.reward for t in probe_episodes(model, tokenizer, recipe, probe, step, task)]
            success, domains = sum(rewards) / len(rewards), _by_domain(probe, rewards)
            bar.set_postfix(loss=f"{loss.item():.3f}", sampled_success=f"{success:.2f}")
            shown = "".join(f", {d} {s:.3f}" for d, s in domains.items() if d)
            log.info(
                "warm start step %d: loss %.4f, sampled success %.3f%s", step, loss.item(), success, shown
            )
            if w.target_per_domain:
                if missing := sorted(set(w.target_domains) - domains.keys()):
                    raise ValueError(
                        f"warmstart.target_domains names {missing}, which no probe task is tagged with "
                        f"(its domains: {sorted(domains)})"
                    )
                watched = [domains[d] for d in w.target_domains] if w.target_domains else domains.values()
            reached = min(watched) if w.target_per_domain else success
            if reached >= w.target_success:
                break
    bar.close()
    model.save_pretrained(path)
    info: dict = {"steps": step, "sampled_success": success}
    if len(domains) > 1:
        info["by_domain"] = domains
    return info


def _demonstrated(recipe: Recipe) -> Task:
    """The recipe's task when the warm start can train on it (it has demonstrations)."""
    task = build_task(recipe.task, recipe.task_tables)
    if not task.demonstrates:
        raise ValueError(
            f"the tiny warm start trains on a task's demonstrations; task {recipe.task!r} has none "
            "(a task defines demonstration(item), see loong_train.tasks.base): "
            "set warmstart.steps = 0 or model.path to a checkpoint"
        )
    return task


def _file_digests(recipe: Recipe) -> dict[str, str]:
    """sha256 of every file the task tables name (data files, ``file.py`` specs), by path."""
    t = recipe.task_tables
    specs = [t.reward.fn, t.environment.cls, t.verifiers.taskset]
    paths = [*t.data.train_files, *t.data.eval_files, *(s.rpartition(":")[0] for s in specs)]
    if t.data.dataset and Path(t.data.dataset).is_dir():  # a local dataset: every file in it
        paths += sorted(str(p) for p in Path(t.data.dataset).rglob("*") if p.is_file())
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths if p and Path(p).is_file()}


def prepare_model(recipe: Recipe, cache_dir: Path) -> Path:
    """The checkpoint RL starts from: the recipe's ``model.path`` (a GGUF file converted,
    :mod:`loong_train.models.source`), or a cached tiny warm-started model."""
    if recipe.model.path:
        return resolve(recipe.model.path, cache_dir)
    # everything that changes the warm start or its stopping point (the probe episodes)
    r = recipe.rollout
    episodes = [r.temperature, r.top_p, r.max_new_tokens, r.max_turns, r.max_model_tokens]
    model = {k: v for k, v in msgspec.to_builtins(recipe.model).items() if k != "trust_remote_code"}
    parts = [model, recipe.warmstart, episodes, recipe.seed, recipe.task, recipe.eval.num_tasks]
    if recipe.task_tables != TaskTables():  # the tables a task is built from ([data], [reasoning_gym], ...)
        parts += [recipe.task_tables, _file_digests(recipe)]  # and what is in the files they name
    key_src = json.dumps(msgspec.to_builtins(parts))
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    path = cache_dir / f"tiny-{recipe.task.replace(':', '-')}-{key}"
    if (path / "warmstart.json").exists():
        return path
    build_tiny(path, recipe)
    info = warm_start(path, recipe) if recipe.warmstart.steps else {"steps": 0}
    (path / "warmstart.json").write_text(json.dumps(info))
    log.info("warm start: %s", info)
    return path
