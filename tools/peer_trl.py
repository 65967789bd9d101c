"""Loong against TRL's GRPOTrainer on the real-model recipe: wall time to the same held-out success.

``tools/peer_trl.sh`` drives it; each subcommand runs in its own environment:

- ``spec`` (Loong's environment): the recipe's model (converted once), hyperparameters, held-out
  questions and the training questions in the order Loong's run draws them, as one JSON file;
- ``loong`` (Loong's environment): ``loong-train run`` on the recipe, timed from the process start;
- ``trl`` (a throwaway environment with ``trl``; never a dependency of Loong): GRPOTrainer on the
  same model, questions, group size, prompts per step, completion length, temperature, optimizer,
  learning-rate schedule and evaluation schedule, on the same cores, evaluated the way TRL samples
  (``model.generate`` with the trainer's generation config);
- ``table``: time until held-out success first reaches ``--target``, per seed, and samples/s.

Both runs count wall time from their process start, evaluations included (the same 128 questions
at the same steps), since a user waits for both. The reward is the task's: 1 when the answer's
last integer is the sum.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

START = time.time()
RECIPE = "smollm2-arithmetic"
MAX_STEPS = 48


def spec(seed: int, out: Path, cache: Path) -> None:
    from loong_train.config import load_recipe
    from loong_train.models.source import resolve
    from loong_train.tasks import build_task

    recipe = load_recipe(RECIPE, [f"seed={seed}"])
    task = build_task(recipe.task, recipe.task_tables)
    held_out = task.held_out(recipe.eval.num_tasks)
    stream = task.train_stream(recipe.seed + 2, held_out)  # the controller's draw (controller.run)
    t, r = recipe.train, recipe.rollout
    train = [next(stream) for _ in range(MAX_STEPS * t.batch_groups)]  # enough for trl --steps
    item = lambda it: {"prompt": it["messages"], "answer": it["answer"]}  # noqa: E731
    out.write_text(
        json.dumps(
            {
                "seed": seed,
                "model": str(resolve(recipe.model.path, cache)),
                "steps": t.steps,
                "lr": t.lr,
                "warmup_steps": t.warmup_steps,
                "weight_decay": t.weight_decay,
                "grad_clip": t.grad_clip,
                "betas": [0.9, 0.99],  # loong_train.backends.torch_backend's AdamW
                "group_size": r.group_size,
                "batch_groups": t.batch_groups,
                "max_new_tokens": r.max_new_tokens,
                "temperature": r.temperature,
                "clip_eps": recipe.loss.clip_eps,
                "eval_every": recipe.eval.every,
                "threads": 2,
                "held_out": [item(it) for it in held_out],
                "train": [item(it) for it in train],
            },
            indent=1,
        )
    )


def loong(seed: int, out: Path) -> None:
    cmd = ["loong-train", "run", RECIPE, "--set", f"seed={seed}", "--out", str(out)]
    subprocess.run(cmd, check=True)
    (out / "peer.json").write_text(
        json.dumps({"process_start": START, "process_wall_s": time.time() - START})
    )


def last_integer(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def trl(spec_path: Path, out: Path, steps: int, stop_at: float, bf16: bool = False) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = json.loads(spec_path.read_text())
    s["steps"] = steps or s["steps"]
    torch.set_num_threads(s["threads"])
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "log.jsonl").open("w")
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], betas=tuple(s["betas"]), weight_decay=s["weight_decay"]
    )
    warmup = max(1, s["warmup_steps"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warmup))

    def reward(completions: list, answer: list[str], **_: object) -> list[float]:
        return [
            float(last_integer(c[-1]["content"]) == int(a)) for c, a in zip(completions, answer, strict=True)
        ]

    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        seed=s["seed"],
        use_cpu=True,
        bf16=bf16,  # mixed precision: float32 weights, bfloat16 autocast
        max_steps=s["steps"],
        per_device_train_batch_size=s["group_size"] * s["batch_groups"],
        gradient_accumulation_steps=1,
        num_generations=s["group_size"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=s["clip_eps"],
        loss_type="dapo",  # the token mean over the batch: Loong's agg_mode = "token-mean"
        num_iterations=1,
        max_grad_norm=s["grad_clip"],
        shuffle_dataset=False,  # the questions in Loong's order
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(s["train"]),
        processing_class=tokenizer,
        optimizers=(optimizer, schedule),
    )

    def evaluate(step: int) -> float:
        began = time.time()
        prompts = [
            tokenizer.apply_chat_template(it["prompt"], tokenize=False, add_generation_prompt=True)
            for it in s["held_out"]
        ]
        tokenizer.padding_side = "left"
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            ids = model.generate(**batch, generation_config=trainer.generation_config)
        model.train()
        texts = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        score = statistics.fmean(
            float(last_integer(t) == int(it["answer"])) for t, it in zip(texts, s["held_out"], strict=True)
        )
        record = {"step": step, "eval": score, "eval_s": time.time() - began, "wall_s": time.time() - START}
        print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
        log.flush()
        return score

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            evaluate(0)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % s["eval_every"] == 0 or state.global_step == s["steps"]:
                control.should_training_stop |= evaluate(state.global_step) >= stop_at

        def on_log(self, args, state, control, logs=None, **kwargs):
            log.write(
                json.dumps({"step": state.global_step, "wall_s": time.time() - START, **(logs or {})}) + "\n"
            )

    trainer.add_callback(Evaluate())
    trainer.train()
    log.write(json.dumps({"process_wall_s": time.time() - START}) + "\n")


def _loong_evals(run: Path) -> tuple[list[tuple[int, float, float]], float]:
    """(version, success, wall seconds from the process start to the evaluation's end) per
    evaluation, and the process wall time. The run directory's clock starts after Ray and the model
    are up (``started_at``): the offset is the time before it."""
    summary = json.loads((run / "summary.json").read_text())
    peer = json.loads((run / "peer.json").read_text())
    offset, process = summary["started_at"] - peer["process_start"], peer["process_wall_s"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [
        (r["eval_policy_version"], r["eval_reward_mean"], offset + r["eval_elapsed_s"])
        for r in rows
        if "eval_reward_mean" in r
    ], process


def _trl_evals(run: Path) -> tuple[list[tuple[int, float, float]], float]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval"], r["wall_s"]) for r in rows if "eval" in r]
    return evals, next(r["process_wall_s"] for r in rows if "process_wall_s" in r)


def _samples_per_s(evals: list[tuple[int, float, float]], samples_per_step: int) -> float:
    """Trained samples per second of wall time, up to the last evaluation."""
    return evals[-1][0] * samples_per_step / evals[-1][2]


def table(runs: Path, target: float) -> None:
    def reach(evals: list[tuple[int, float, float]]) -> tuple[int, float] | None:
        return next(((v, w) for v, x, w in evals if x >= target), None)

    print(
        f"| seed | Loong: step, minutes to {target} | TRL: step, minutes to {target} | TRL / Loong "
        "| last evaluation (Loong, TRL) | samples/s (Loong, TRL) |"
    )
    print("|---|---|---|---|---|---|")
    for loong_run in sorted(runs.glob("loong-s*")):
        seed = loong_run.name.removeprefix("loong-s")
        spec = json.loads((runs / f"spec-s{seed}.json").read_text())
        per_step = spec["group_size"] * spec["batch_groups"]
        a, _ = _loong_evals(loong_run)
        b, _ = _trl_evals(runs / f"trl-s{seed}")
        ra, rb = reach(a), reach(b)
        cell = lambda r: f"{r[0]}, {r[1] / 60:.1f}" if r else "not reached"  # noqa: E731
        if ra and rb:
            ratio = f"{rb[1] / ra[1]:.2f}x"
        elif ra:
            ratio = f"over {b[-1][2] / ra[1]:.2f}x"
        else:
            ratio = "-"
        last = f"{a[-1][1]:.2f} (step {a[-1][0]}), {b[-1][1]:.2f} (step {b[-1][0]})"
        rates = f"{_samples_per_s(a, per_step):.2f}, {_samples_per_s(b, per_step):.2f}"
        print(f"| {seed} | {cell(ra)} | {cell(rb)} | {ratio} | {last} | {rates} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("spec")
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument(
        "--cache", type=Path, default=Path(os.environ.get("LOONG_CACHE", Path.home() / ".cache/loong"))
    )
    a = sub.add_parser("loong")
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--out", type=Path, required=True)
    a = sub.add_parser("trl")
    a.add_argument("spec", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--steps", type=int, default=0, help="train steps (default: the recipe's)")
    a.add_argument("--stop-at", type=float, default=2.0, help="stop once held-out success reaches this")
    a.add_argument("--bf16", action="store_true", help="TRL's bfloat16 mixed precision (autocast)")
    a = sub.add_parser("table")
    a.add_argument("runs", type=Path)
    a.add_argument("--target", type=float, default=0.4)
    args = p.parse_args()
    if args.cmd == "spec":
        spec(args.seed, args.out, args.cache)
    elif args.cmd == "loong":
        loong(args.seed, args.out)
    elif args.cmd == "trl":
        trl(args.spec, args.out, args.steps, args.stop_at, args.bf16)
    else:
        table(args.runs, args.target)


if __name__ == "__main__":
    sys.exit(main())
