"""The single controller: one process that drives rollout workers and the trainer (Ray actors).

The driver is the loop of docs/architecture.md, "The asynchronous loop":

1. the controller owns the data, the staleness window and the ledger;
2. rollout workers run agents continuously, every token stamped with its weight version;
3. finished groups enter the window; the trainer takes a batch only of samples within
   ``max_staleness`` versions, and admission keeps at most ``(max_staleness + 1) * batch``
   groups in flight (``max_staleness = 0`` is synchronous on-policy training, same code);
4. after each train step the version advances and TransferMesh carries the weights to every
   engine, queued behind the work already admitted at the old version (``rollout.engine.partial``:
   landing mid-generation instead, the running requests continuing under the new version);
5. everything that matters is measured every step.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import msgspec
import ray
from tqdm import tqdm

from loong_agentflow import EpisodeLimits, Latency
from loong_core.config import ConfigError
from loong_core.window import StalenessWindow
from loong_train import plugins, ray_env
from loong_train.backends.base import BackendOptions, backend_problem
from loong_train.backends.config import FsdpBackendConfig, TorchBackendConfig, require_installed
from loong_train.config import Recipe
from loong_train.cores import remove_board
from loong_train.curriculum import Curriculum
from loong_train.engines.config import SGLangEngineConfig
from loong_train.evaluator import Evaluator
from loong_train.messages import ApplyResult, Published, RolloutDone
from loong_train.models.checkpoint import check_checkpoint
from loong_train.models.source import resolve
from loong_train.pipeline import Pipeline
from loong_train.run import checkpoint
from loong_train.run.checkpoint import Checkpoint, Stateful
from loong_train.run.loggers import require_loggers
from loong_train.run.writer import RunDir
from loong_train.scheduler import Scheduler
from loong_train.source import GroupSource
from loong_train.tasks import Task, build_task, registered
from loong_train.workers.agent import BlackboxAgentConfig, agent_program
from loong_train.workers.rollout import RolloutWorker
from loong_train.workers.trainer import TrainerWorker
from loong_transfermesh import TransportConfig, remove_slots

__all__ = ["run", "trainer_options"]

log = logging.getLogger("loong.controller")


def run(recipe: Recipe, out: Path, cache: Path, resume: bool = False) -> Path:
    """Train ``recipe``; writes the run directory ``out`` and returns it. ``resume``: continue the
    run in ``out`` from its newest checkpoint (:mod:`loong_train.run.checkpoint`)."""
    out, cache = out.absolute(), cache.absolute()  # Ray actors may run in another working directory
    task = _preflight(recipe)
    held_out = task.held_out(recipe.eval.num_tasks)
    model_path = str(_prepare_model(recipe, cache))
    _check_model(recipe, model_path)  # what the workers would fail on, before Ray starts
    if recipe.opd.build:  # OPD recipes: build their teachers
        recipe = plugins.teacher_builder().prepare(recipe, cache, Path(model_path))
    ckpt = checkpoint.latest(out, recipe) if resume else None
    e = recipe.eval
    evaluator = Evaluator(held_out, seed=recipe.seed, every=e.every, last=recipe.train.steps)
    run_dir = RunDir(out, recipe, recipe.rollout.workers)
    started_ray = ray_env.starts_ray()
    transport = msgspec.structs.replace(recipe.transport, name=run_dir.name).with_free_port()
    curriculum = Curriculum(recipe.curriculum, recipe.seed) if recipe.curriculum.enabled else None
    source = GroupSource(  # the warm start used seed + 1
        task.train_stream(recipe.seed + 2, held_out),
        recipe.rollout.group_size,
        seed=recipe.seed,
        curriculum=curriculum,
    )
    pipe = None
    try:
        pipe = _start(recipe, model_path, transport, run_dir.path, ckpt, source)
        if ckpt:
            checkpoint.restore(_components(pipe, run_dir, evaluator), ckpt)
            log.info(
                "resumed from %s: step %d, %d groups to issue again",
                ckpt.path,
                ckpt.version,
                len(pipe.window.reissue),
            )
        run_dir.begin()
        if pipe.sync.updates_wait_for_queued_evaluations:
            pipe.admit()  # the first batches go ahead of the first evaluation: training starts sooner
        evaluator.begin(pipe)
        _train(recipe, pipe, run_dir, evaluator, ckpt.version if ckpt else None)
        if pipe.stopped:
            log.warning(
                "the run ends at step %d of %d: %s", pipe.window.version, recipe.train.steps, pipe.stopped
            )
            evaluator.stop_at(pipe, pipe.window.version)
        pipe.drain()
        _collect(evaluator, run_dir, wait=True)
        pipe.save_final(run_dir.path / "checkpoints" / "final")
        run_dir.on_scheduling(pipe.scheduler.take_journal())
        run_dir.finish(pipe.window.version, pipe.counters, evaluator.lost, pipe.stopped)
    finally:
        run_dir.close()
        if pipe is not None:  # None: _start raised, having ended the actors it began
            pipe.shutdown()
        remove_slots(run_dir.name)  # also when the trainer died before unlinking them
        remove_board(run_dir.name)
        if started_ray:
            ray.shutdown()
    return run_dir.path


def _train(
    recipe: Recipe, pipe: Pipeline, run_dir: RunDir, evaluator: Evaluator, resumed_from: int | None
) -> None:
    """Steps 1-6 of the loop until the last version is published, or the pipeline has nothing
    left to train (``pipe.stopped``, once no step is in flight)."""
    steps = recipe.train.steps
    bar = tqdm(total=steps, initial=pipe.window.version, desc=recipe.name, unit="step")
    while pipe.window.version < steps and not (pipe.stopped and pipe.train_ref is None):
        pipe.admit()
        for event in pipe.wait():
            match event:
                case RolloutDone():
                    pipe.on_rollout(event)
                    run_dir.on_rollout(event.result)
                case ApplyResult():
                    run_dir.on_applied(event)
                case Published():
                    _published(recipe, pipe, run_dir, evaluator, event, resumed_from)
                    bar.update(1)
                    bar.set_postfix(run_dir.postfix())
        if (trajs := pipe.start_train_step()) is not None:
            run_dir.on_batch(trajs, pipe.window.last_batch_staleness, pipe.take_draw())
    bar.close()


def _published(
    recipe: Recipe,
    pipe: Pipeline,
    run_dir: RunDir,
    evaluator: Evaluator,
    p: Published,
    resumed_from: int | None,
) -> None:
    """A train step's weights were pushed: the engines get them, the version is evaluated when
    due, the step's lines are written, and a checkpoint when due."""
    pipe.sync_weights(p.manifest)  # the window advances to the new version
    v = pipe.window.version
    evaluator.after_step(pipe, v)
    _collect(evaluator, run_dir, wait=v == recipe.train.steps)
    run_dir.on_train_step(v, p, pipe.counters)
    run_dir.on_scheduling(pipe.scheduler.take_journal())
    if checkpoint.due(recipe.train, v):
        components = _components(pipe, run_dir, evaluator)
        checkpoint.save(run_dir.path, v, recipe, components, pipe.save_checkpoint, protect=resumed_from)


def _components(pipe: Pipeline, run_dir: RunDir, evaluator: Evaluator) -> dict[str, Stateful]:
    """What a checkpoint keeps of the controller's side, by name (:mod:`loong_train.run.checkpoint`)."""
    return {
        "source": pipe.source,
        "scheduler": pipe.scheduler,
        "pipeline": pipe,
        "evaluator": evaluator,
        "run_dir": run_dir,
    }


def _prepare_model(recipe: Recipe, cache: Path) -> Path:
    """The checkpoint RL starts from: ``[model] path`` (a GGUF file converted, :mod:`loong_train.models.source`),
    or without one, what the installed model builder makes (:mod:`loong_train.plugins`)."""
    if recipe.model.path:
        return resolve(recipe.model.path, cache)
    return plugins.model_builder().prepare(recipe, cache)


def _collect(evaluator: Evaluator, run_dir: RunDir, wait: bool) -> None:
    """Hand the evaluations that finished to the run directory (``wait``: all queued ones)."""
    for result in evaluator.collect(wait):
        run_dir.on_eval(result)


def trainer_options(recipe: Recipe) -> dict[str, Any]:
    """The trainer's share of ``recipe`` (``TrainerWorker``'s keyword arguments)."""
    t = recipe.train
    options = BackendOptions(
        backend=t.backend,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        loss=recipe.loss,
        temperature=recipe.rollout.temperature,
        threads=recipe.trainer_threads,
        trust_remote_code=recipe.model.trust_remote_code,
        lora=t.lora,
    )
    r = recipe.rollout
    direct = isinstance(r.engine, SGLangEngineConfig) and r.engine.weights == "direct"
    return {
        "options": options,
        "seed": recipe.seed,
        "opd": recipe.opd,
        "receivers": 0 if direct else r.workers,
        "servers": r.engine.pusher(r.workers) if direct else None,  # the trainer pushes into each
        "watch_interval_s": r.engine.health_interval_s if direct else 1.0,
    }


def _check_model(recipe: Recipe, model_path: str) -> None:
    """The checkpoint loads (:func:`check_checkpoint`), LoRA's target modules exist in it, and the
    train backend covers its family."""
    choice = check_checkpoint(model_path, recipe.model.trust_remote_code)
    if recipe.train.lora.enabled:
        from loong_train.models.adapters import checkpoint_root, target_names
        from loong_train.models.auto import skeleton

        model = skeleton(model_path, recipe.model.trust_remote_code)
        try:
            target_names(checkpoint_root(model), recipe.train.lora.target_modules)
        except ValueError as e:
            raise ConfigError(f"model.path {model_path}: {e}") from None
    if isinstance(recipe.train.backend, TorchBackendConfig | FsdpBackendConfig):
        return
    if choice.path == "generic":
        raise ConfigError(
            f"train.backend.type = {recipe.train.backend.type!r} maps the weights of Loong's decoder "
            f"families only; model.path {model_path} takes the generic path ({choice.reason}): "
            'use train.backend.type = "torch"'
        )
    import json

    from loong_train.models.decoder import DecoderConfig

    config = DecoderConfig.from_hf(json.loads((Path(model_path) / "config.json").read_text()))
    if problem := backend_problem(recipe.train.backend, config):
        raise ConfigError(f"train.backend.type = 'megatron' cannot train model.path {model_path}: {problem}")


def _preflight(recipe: Recipe) -> Task:
    """The recipe's task, after failing before any work on what the workers would fail on: the
    task, the train backend's and the loggers' extras, the agent program."""
    task = build_task(recipe.task, recipe.task_tables)
    require_installed(recipe.train.backend)
    require_loggers(recipe.log)
    r, blackbox = recipe.rollout, isinstance(recipe.agent, BlackboxAgentConfig)
    if blackbox:
        agent_program(recipe.agent, task, EpisodeLimits(r.max_turns, r.max_model_tokens, r.episode_timeout_s))
    if r.tool_latency_ms and (blackbox or task.runs_own_agent):
        owner = "agent.type = 'blackbox'" if blackbox else f"task {recipe.task!r} (an environment)"
        raise ConfigError(
            f"rollout.tool_latency_ms = {r.tool_latency_ms} delays the tools Loong runs for white-box "
            f"episodes (the task's tools()), but {owner} runs its own: set the latency there, or "
            "leave rollout.tool_latency_ms at 0"
        )
    return task


def _start(
    recipe: Recipe,
    model_path: str,
    transport: TransportConfig,
    run_path: Path,
    ckpt: Checkpoint | None,
    source: GroupSource,
) -> Pipeline:
    """Ray, the rollout workers and the trainer (logs in ``run_path/logs``); resumed, all three
    start from ``ckpt``. Each actor reserves its torch threads as CPUs (``threads``; the
    trainer's ``train.threads``) and its GPUs, so Ray places them by resources."""
    ray_env.connect(recipe)
    engine_path, version = (str(ckpt.path), ckpt.version) if ckpt else (model_path, 0)
    adapter = ""
    if ckpt and _adapter_updates(recipe):  # the engines merge adapters into the base weights
        engine_path, adapter = model_path, str(ckpt.path / "adapter")
    cores = transport.name if recipe.train.borrow_idle_threads else ""  # the run's name, as its slots'
    logs = run_path / "logs"
    workers, trainer = [], None
    try:
        if transport.type == "tcp" and _host(transport.address) in _WILDCARD:
            # the sender binds every interface of a node Ray picks: workers learn its address from it
            trainer = _start_trainer(recipe, model_path, transport, [], cores)
            transport = msgspec.structs.replace(transport, address=ray.get(trainer.weights_address.remote()))
            workers = _start_workers(recipe, engine_path, version, transport, logs, adapter, cores)
        else:
            workers = _start_workers(recipe, engine_path, version, transport, logs, adapter, cores)
            trainer = _start_trainer(recipe, model_path, transport, workers, cores)
        _check_reach(recipe, transport, trainer, workers)
        if ckpt:
            ray.get(trainer.load_checkpoint.remote(str(ckpt.path)))
        window = StalenessWindow(recipe.train.max_staleness, recipe.train.batch_groups)
        scheduler = Scheduler(window, steps=recipe.train.steps)
        return Pipeline(recipe, workers, trainer, scheduler, source, model_path, run_path)
    except BaseException:  # an actor that died in its constructor, a checkpoint that would not load
        _end([actor for actor in (*workers, trainer) if actor is not None])
        raise


def _end(actors: list, wait_s: float = 30.0) -> None:
    """Kill ``actors`` and wait (at most ``wait_s``) until each is gone, so that nothing a
    constructor still running writes (a core board, shared-memory slots) outlives the cleanup
    that follows."""
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception as e:  # already gone, or Ray going down: the others still get killed
            log.warning("could not kill %s: %s", actor, e)
    for actor in actors:
        # raises once it is gone; any other failure (Ray itself going down) must not hide the
        # error that ended the start
        with contextlib.suppress(Exception):
            ray.get(actor.__ray_ready__.remote(), timeout=wait_s)


_WILDCARD = ("0.0.0.0", "::", "")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _check_reach(recipe: Recipe, transport: TransportConfig, trainer: Any, workers: list) -> None:
    """Refuse, before any step, a transport that cannot reach a rollout worker: ``shm`` and a
    loopback ``tcp`` address reach workers on the trainer's node only (direct weights go from the
    trainer to the servers' URLs, checked by the pusher)."""
    engine = recipe.rollout.engine
    if isinstance(engine, SGLangEngineConfig) and engine.weights == "direct":
        return
    if transport.type == "tcp" and _host(transport.address) not in _LOOPBACK:
        return
    node, ip = ray.get(trainer.node.remote())
    placed = ray.get([w.node.remote() for w in workers])
    far = [
        f"worker {i} on {where[1]} (node {where[0][:12]})"
        for i, where in enumerate(placed)
        if where[0] != node
    ]
    if not far:
        return
    what = "type 'shm'" if transport.type == "shm" else f"type 'tcp' on loopback ({transport.address})"
    raise ConfigError(
        f"transport {what} reaches rollout workers on the trainer's node only ({ip}, node {node[:12]}), "
        f"but Ray placed {', '.join(far)}: set transport.type = 'tcp' with transport.address = "
        "'0.0.0.0:0' (the trainer's node address is found at start) and a transport.key"
    )


def _adapter_updates(recipe: Recipe) -> bool:
    """Weight updates are LoRA adapters alone (``[train.lora] sync = "adapter"``)."""
    return recipe.train.lora.enabled and recipe.train.lora.sync == "adapter"


def _start_workers(
    recipe: Recipe,
    engine_path: str,
    version: int,
    transport: TransportConfig,
    log_dir: Path,
    adapter: str,
    cores: str,
) -> list:
    """``rollout.workers`` rollout worker actors, their engines loading ``engine_path`` at ``version``
    (with ``adapter``, a checkpoint's LoRA adapter, merged in), lending their threads on board
    ``cores`` while they rest (:mod:`loong_train.cores`; "": not)."""
    r = recipe.rollout
    sampling = {"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens}
    limits = {
        "max_turns": r.max_turns,
        "max_model_tokens": r.max_model_tokens,
        "timeout_s": r.episode_timeout_s,
    }
    gpus = r.engine.gpus  # an sglang worker's server runs on its GPUs
    # "weights": updates apply beside running rollouts (partial rollouts, concurrent calls);
    # "rollout": the calls a worker runs at once
    groups = {"weights": 1, "rollout": r.engine.concurrent_calls}
    worker_actor = ray.remote(
        num_cpus=recipe.threads, num_gpus=gpus, max_restarts=r.max_restarts, concurrency_groups=groups
    )(RolloutWorker)
    return [
        worker_actor.remote(
            engine_path,
            version=version,
            seed=recipe.seed * 1000 + i,
            sampling=sampling,
            limits=limits,
            transport=transport,
            threads=recipe.threads,
            worker_id=i,
            agent=recipe.agent,
            engine=r.engine,
            log_dir=str(log_dir),
            task=registered(recipe.task) or recipe.task,  # a task made in code: its factory
            tables=recipe.task_tables,
            trust_remote_code=recipe.model.trust_remote_code,
            tool_latency=Latency(r.tool_latency_ms / 1000, r.tool_latency_sigma)
            if r.tool_latency_ms
            else None,
            lora=recipe.train.lora if _adapter_updates(recipe) else None,
            adapter=adapter,
            cores=cores,
        )
        for i in range(r.workers)
    ]


def _start_trainer(recipe: Recipe, model_path: str, transport: TransportConfig, workers: list, cores: str):
    """The trainer actor, from the initial model (which stays the KL reference when resumed),
    borrowing the threads lent on board ``cores`` ("": none)."""
    b = recipe.train.backend
    ranks = isinstance(b, FsdpBackendConfig)  # the ranks reserve their own CPUs
    trainer_actor = ray.remote(num_cpus=0 if ranks else recipe.trainer_threads, num_gpus=b.trainer_gpus)(
        TrainerWorker
    )
    options = trainer_options(recipe)
    if options["servers"] is not None:  # direct weights: to the servers where Ray placed them
        urls = ray.get([w.server_url.remote() for w in workers])
        options["servers"] = msgspec.structs.replace(options["servers"], urls=urls)
    return trainer_actor.remote(model_path, transport=transport, cores=cores, **options)
