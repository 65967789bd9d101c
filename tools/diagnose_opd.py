"""Why does a distilled student trail its teachers? Where its own samples leave the teacher.

    uv run python tools/diagnose_opd.py RUN_DIR [--checkpoint DIR] [--top-k 16] [--low 0.05]

Samples one episode per held-out task of the run's recipe from the student (``--checkpoint``,
default ``RUN_DIR/checkpoints/final``; the warm start, a teacher or any checkpoint works) at the
rollout temperature, routes each by its domain tag to the teacher the run used, and scores every
model token under both. Per domain it prints:

- ``success``: the episodes' mean reward (the run's held-out success, one sample per task);
- ``outside_top_k``: the student's probability mass outside the teacher's ``top_k`` tokens, mean
  over tokens (``teacher_outside``: the teacher's own mass there), the floor a label-smoothed or
  under-trained student samples from at every token;
- ``forward_kl``: KL(teacher || student) per token over the whole vocabulary;
- ``improbable``: the share of sampled tokens the teacher gives less than ``--low``;
- ``failed``: failed episodes; ``failed_with``: how many of them hold such a token
  (``succeeded_with``: the successful ones that hold one). If every failure holds one and no
  success does, the student fails where it samples what its teacher would not, rather than where
  the teacher itself goes wrong.

Needs a run whose ``[opd.teachers]`` are local checkpoints (the tiny recipes build theirs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from loong_teacher import LocalTeacherConfig
from loong_train.config import Recipe, load_recipe
from loong_train.models.decoder import CausalLM
from loong_train.models.tokenizer import load_tokenizer
from loong_train.tasks import build_task
from loong_train.tiny.warmstart import probe_episodes

COLUMNS = (
    "success",
    "outside_top_k",
    "teacher_outside",
    "forward_kl",
    "improbable",
    "failed",
    "failed_with",
    "succeeded_with",
)


def token_stats(
    student: torch.Tensor, teacher: torch.Tensor, sampled: torch.Tensor, k: int, low: float
) -> dict:
    """Sums over one episode's model tokens: ``student``/``teacher`` log-probabilities ``[tokens,
    vocab]`` at the positions that predicted them, ``sampled`` ``[tokens]`` the tokens drawn.
    ``improbable`` counts sampled tokens with teacher probability below ``low``."""
    top = teacher.topk(k, dim=-1).indices
    p = teacher.exp()
    return {
        "tokens": len(sampled),
        "outside_top_k": float((1 - student.exp().gather(-1, top).sum(-1)).sum()),
        "teacher_outside": float((1 - p.gather(-1, top).sum(-1)).sum()),
        "forward_kl": float((p * (teacher - student)).sum()),
        "improbable": int((p.gather(-1, sampled[:, None]).squeeze(-1) < low).sum()),
    }


def summarize(episodes: list[tuple[float, dict]]) -> dict:
    """Per-token means and episode counts from (reward, :func:`token_stats`) pairs."""
    n = sum(s["tokens"] for _, s in episodes) or 1
    failed = [s for r, s in episodes if r < 1]
    return {
        "success": sum(r for r, _ in episodes) / len(episodes),
        **{
            key: sum(s[key] for _, s in episodes) / n
            for key in ("outside_top_k", "teacher_outside", "forward_kl")
        },
        "improbable": sum(s["improbable"] for _, s in episodes) / n,
        "failed": len(failed),
        "failed_with": sum(1 for s in failed if s["improbable"]),
        "succeeded_with": sum(1 for r, s in episodes if r >= 1 and s["improbable"]),
    }


def log_probs(model: CausalLM, token_ids: list[int], mask: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's log-probabilities at the positions predicting each model token, and those tokens."""
    ids = torch.tensor([token_ids])
    keep = torch.tensor(mask[1:], dtype=torch.bool)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0, :-1].double(), dim=-1)
    return logp[keep], ids[0, 1:][keep]


def diagnose(recipe: Recipe, checkpoint: Path, k: int, low: float) -> dict[str, dict]:
    teachers = recipe.opd.teachers
    if teachers is None or not all(isinstance(t, LocalTeacherConfig) and t.path for t in teachers.teachers):
        raise SystemExit("the run's [opd.teachers] must all be local checkpoints with a path")
    tag = teachers.route_tag
    student, tokenizer = CausalLM.from_pretrained(checkpoint), load_tokenizer(checkpoint)
    task = build_task(recipe.task, recipe.task_tables)
    held_out = task.held_out(recipe.eval.num_tasks)
    out = {}
    for teacher_cfg in teachers.teachers:
        for domain in teacher_cfg.tags:
            tasks = [t for t in held_out if t.get("tags", {}).get(tag) == domain]
            if not tasks:
                continue
            teacher = CausalLM.from_pretrained(Path(teacher_cfg.path))
            trajs = probe_episodes(student, tokenizer, recipe, tasks, recipe.seed, task)
            episodes = []
            for traj in trajs:
                s, sampled = log_probs(student, traj.token_ids, traj.loss_mask)
                t, _ = log_probs(teacher, traj.token_ids, traj.loss_mask)
                episodes.append((traj.reward, token_stats(s, t, sampled, k, low)))
            out[domain] = summarize(episodes) | {"teacher_name": teacher_cfg.name}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run directory (its config.toml names the teachers)")
    parser.add_argument("--checkpoint", type=Path, help="the student (default: RUN/checkpoints/final)")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--low", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(str(args.run / "config.toml"))
    result = diagnose(recipe, args.checkpoint or args.run / "checkpoints" / "final", args.top_k, args.low)
    print("| domain | teacher | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for domain, row in result.items():
        cells = [f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS]
        print(f"| {domain} | {row['teacher_name']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
