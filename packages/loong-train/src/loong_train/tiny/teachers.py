"""Teachers for the tiny OPD recipe, made with the tiny warm start and cached like the student.

Each ``[[opd.build]]`` teacher is the student's warm-started checkpoint trained further on one
domain's demonstrations (its ``task``) until its sampled success reaches the build's target; its
held-out success per domain is stored with it (``teacher.json``), for the run's summary and plots.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import msgspec

from loong_teacher import LocalTeacherConfig
from loong_train.algo.config import TeacherBuild
from loong_train.config import Recipe
from loong_train.models.decoder import CausalLM
from loong_train.models.tokenizer import load_tokenizer
from loong_train.tasks import build_task
from loong_train.tiny.warmstart import sampled_success, warm_start

__all__ = ["prepare_teachers", "teacher_success"]


def prepare_teachers(recipe: Recipe, cache_dir: Path, student: Path) -> Recipe:
    """The recipe with every ``[[opd.build]]`` teacher built (or found in the cache) and its path set."""
    o = recipe.opd
    if o.teachers is None or not o.build:
        return recipe
    builds = {b.teacher: b for b in o.build}
    teachers = [
        msgspec.structs.replace(t, path=str(_build_teacher(recipe, builds[t.name], cache_dir, student)))
        if isinstance(t, LocalTeacherConfig) and not t.path and t.name in builds
        else t
        for t in o.teachers.teachers
    ]
    replace = msgspec.structs.replace
    return replace(recipe, opd=replace(o, teachers=replace(o.teachers, teachers=teachers)))


def _build_teacher(recipe: Recipe, build: TeacherBuild, cache_dir: Path, student: Path) -> Path:
    r = recipe.rollout
    episodes = [r.temperature, r.top_p, r.max_new_tokens, r.max_turns, r.max_model_tokens]
    parts = [str(student), build, recipe.warmstart, episodes, recipe.seed, recipe.task, recipe.eval.num_tasks]
    key = hashlib.sha256(json.dumps(msgspec.to_builtins(parts)).encode()).hexdigest()[:16]
    path = cache_dir / f"teacher-{build.teacher}-{key}"
    if (path / "teacher.json").exists():
        return path
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(student, tmp)
    w = msgspec.structs.replace(
        recipe.warmstart,
        steps=build.steps,
        lr=build.lr,
        label_smoothing=build.label_smoothing,
        target_success=build.target_success,
    )
    info = warm_start(tmp, msgspec.structs.replace(recipe, task=build.task, warmstart=w))
    info["held_out_success"] = _held_out_success(tmp, recipe)
    (tmp / "teacher.json").write_text(json.dumps(info))
    tmp.rename(path)
    return path


def _held_out_success(path: Path, recipe: Recipe) -> dict[str, float]:
    """Sampled success of the checkpoint at ``path`` on the run's held-out set, per domain."""
    model, tokenizer = CausalLM.from_pretrained(path), load_tokenizer(path)
    held_out = build_task(recipe.task, recipe.task_tables).held_out(recipe.eval.num_tasks)
    by_domain: dict[str, list[dict]] = {}
    for t in held_out:
        by_domain.setdefault(t.get("tags", {}).get("domain", ""), []).append(t)
    return {d: sampled_success(model, tokenizer, recipe, ts, seed=recipe.seed) for d, ts in by_domain.items()}


def teacher_success(recipe: Recipe) -> dict[str, dict[str, float]]:
    """Each built teacher's held-out success per domain (from its cache entry), by teacher name."""
    teachers = recipe.opd.teachers.teachers if recipe.opd.teachers is not None else []
    out = {}
    for t in teachers:
        if isinstance(t, LocalTeacherConfig) and (Path(t.path) / "teacher.json").exists():
            out[t.name] = json.loads((Path(t.path) / "teacher.json").read_text())["held_out_success"]
    return out
