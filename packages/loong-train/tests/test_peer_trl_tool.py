"""``tools/peer_trl.py``'s bookkeeping on hand-made run logs (no training here): when each
framework first reaches the target, counted from its process start, and the table."""

from __future__ import annotations

import json

import peer_trl


def _loong_run(path, evals: list[tuple[int, float, float]], clock_after: float, process_s: float) -> None:
    """A Loong run directory: evaluations as (version, success, run-directory seconds at the
    evaluation's end); its clock starts ``clock_after`` seconds after the process."""
    path.mkdir()
    rows = [
        {
            "step": i + 1,
            "elapsed_s": t + 5.0,
            "eval_policy_version": v,
            "eval_reward_mean": x,
            "eval_elapsed_s": t,
        }
        for i, (v, x, t) in enumerate(evals)
    ]  # a line is written after the evaluation it reports ended
    rows.insert(1, {"step": 9, "elapsed_s": 50.0})  # a step without an evaluation
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"wall_s": process_s, "started_at": 1e9 + clock_after}))
    (path / "peer.json").write_text(json.dumps({"process_start": 1e9, "process_wall_s": process_s}))


def _trl_run(path, evals: list[tuple[int, float, float]], process_s: float) -> None:
    path.mkdir()
    rows = [{"step": s, "eval": x, "eval_s": 20.0, "wall_s": t} for s, x, t in evals]
    rows.insert(1, {"step": 1, "wall_s": 40.0, "loss": 0.1})  # a log row
    rows.append({"process_wall_s": process_s})
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_time_to_target_counts_from_the_process_start(tmp_path, capsys):
    for seed in (0, 1):
        (tmp_path / f"spec-s{seed}.json").write_text(json.dumps({"group_size": 8, "batch_groups": 4}))
    # Loong: its run directory's clock starts 30 s after the process; reaches 0.4 at version 8,
    # whose evaluation ends at 150 s on that clock
    _loong_run(
        tmp_path / "loong-s0",
        [(0, 0.1, 40.0), (4, 0.3, 100.0), (8, 0.45, 150.0), (12, 0.6, 198.0)],
        30.0,
        240.0,
    )
    _trl_run(tmp_path / "trl-s0", [(0, 0.1, 30.0), (4, 0.2, 150.0), (8, 0.41, 300.0)], 310.0)
    # seed 1: TRL never reaches the target within its 8 steps
    _loong_run(tmp_path / "loong-s1", [(0, 0.1, 40.0), (4, 0.5, 90.0)], 20.0, 130.0)
    _trl_run(tmp_path / "trl-s1", [(0, 0.1, 30.0), (8, 0.3, 270.0)], 280.0)
    peer_trl.table(tmp_path, 0.4)
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 0") or line.startswith("| 1")
    ]
    # seed 0: Loong 30 + 150 = 180 s = 3.0 min, TRL 300 s = 5.0 min: 300 / 180 = 1.67x;
    # samples/s to the last evaluation: Loong 12 x 32 / (30 + 198), TRL 8 x 32 / 300
    assert rows[0] == "| 0 | 8, 3.0 | 8, 5.0 | 1.67x | 0.60 (step 12), 0.41 (step 8) | 1.68, 0.85 |"
    # seed 1: Loong 20 + 90 = 110 s; TRL's last evaluation at 270 s: over 270 / 110 = 2.45x
    assert rows[1] == "| 1 | 4, 1.8 | not reached | over 2.45x | 0.50 (step 4), 0.30 (step 8) | 1.16, 0.95 |"
