"""``tools/compare_opd.py``'s bookkeeping on hand-made run summaries (no training here): mean
curves over seeds, the steps at which a variant reaches 0.9x its teacher and the level where the
baseline ends, the table and the plot."""

from __future__ import annotations

import compare_opd
import pytest

TEACHERS = {
    "add": {"teacher": "add-teacher", "held_out_success": 0.9},
    "mul": {"teacher": "mul-teacher", "held_out_success": 1.0},
}


def _summary(add: list[float], mul: list[float], wall_s: float) -> dict:
    """Evaluations at steps 0, 10, 20, ... (JSON keys, as summary.json has them)."""
    by = {d: {str(10 * i): x for i, x in enumerate(xs)} for d, xs in (("add", add), ("mul", mul))}
    return {"eval_reward_by_domain": by, "teacher_by_domain": TEACHERS, "wall_s": wall_s}


def test_steps_to_the_teacher_and_to_the_baselines_final_level():
    summaries = {
        "RL only": [
            _summary([0.1, 0.3, 0.5], [0.2, 0.4, 0.6], 120.0),
            _summary([0.1, 0.5, 0.7], [0.2, 0.2, 0.4], 180.0),
        ],  # final means: add 0.6, mul 0.5
        "OPD": [
            _summary([0.1, 0.8, 0.9], [0.2, 0.9, 1.0], 150.0),
            _summary([0.1, 0.6, 0.7], [0.2, 0.5, 0.8], 150.0),
        ],  # means: add 0.1, 0.7, 0.8; mul 0.2, 0.7, 0.9
    }
    out = compare_opd.compare(summaries)
    add, mul = out["domains"]["add"], out["domains"]["mul"]
    assert out["baseline"] == "RL only"
    assert add["OPD"]["curve"] == [
        (0, 0.1, 0.1, 0.1),
        (10, pytest.approx(0.7), 0.6, 0.8),
        (20, 0.8, 0.7, 0.9),
    ]
    assert add["RL only"]["final"] == pytest.approx(0.6) and add["OPD"]["final_per_seed"] == [0.9, 0.7]
    # 0.9 x teacher: 0.81 on add (OPD's mean ends at 0.8: not reached), 0.9 on mul (step 20)
    assert add["OPD"]["steps_to_teacher"] is None and mul["OPD"]["steps_to_teacher"] == 20
    assert add["RL only"]["steps_to_teacher"] is None
    # the level where RL only ends: add 0.6 (OPD at step 10), mul 0.5 (OPD at step 10; RL at 20)
    assert add["OPD"]["steps_to_baseline_final"] == 10 and mul["OPD"]["steps_to_baseline_final"] == 10
    assert mul["RL only"]["steps_to_baseline_final"] == 20
    assert add["RL only"]["wall_s"] == 150.0
    lines = compare_opd.table(out).splitlines()
    assert lines[2] == "| add | teacher 'add-teacher' | 0.90 | 0.90, 0.90 | | | |"
    assert lines[4] == "| add | OPD | 0.80 | 0.90, 0.70 | not reached | 10 | 2.5 min |"


def test_each_seeds_teacher_counts_in_the_teacher_level():
    """Every seed builds its own teachers: 0.9x teacher is taken of their mean over seeds."""

    def run(add_teacher: float, add: list[float]) -> dict:
        s = _summary(add, [0.2, 0.2], 60.0)
        return s | {
            "teacher_by_domain": {**TEACHERS, "add": {**TEACHERS["add"], "held_out_success": add_teacher}}
        }

    out = compare_opd.compare({"RL only": [run(1.0, [0.1, 0.8]), run(0.8, [0.1, 0.9])]})
    teacher = out["teachers"]["add"]
    assert teacher["per_seed"] == [1.0, 0.8] and teacher["held_out_success"] == pytest.approx(0.9)
    # the mean curve ends at 0.85: at least 0.81 (0.9 x the mean teacher), below seed 0's 0.9
    assert out["domains"]["add"]["RL only"]["steps_to_teacher"] == 10
    assert (
        compare_opd.table(out).splitlines()[2] == "| add | teacher 'add-teacher' | 0.90 | 1.00, 0.80 | | | |"
    )


def test_a_mean_curve_keeps_the_steps_every_seed_evaluated():
    runs = [[(0, 0.0), (10, 0.5), (20, 1.0)], [(0, 0.2), (20, 0.6)]]  # the second run skipped step 10
    assert compare_opd.mean_curve(runs) == [(0, 0.1, 0.0, 0.2), (20, 0.8, 0.6, 1.0)]


def test_runs_that_share_no_step_are_refused():
    with pytest.raises(ValueError, match="share no evaluated step"):
        compare_opd.mean_curve([[(0, 0.1)], [(10, 0.2)]])


def test_a_variant_spec_names_its_overrides():
    assert compare_opd.parse_variant("RL only=opd.enabled=false") == ("RL only", ["opd.enabled=false"])
    assert compare_opd.parse_variant("OPD=") == ("OPD", [])
    spec = "dense=opd.objective='forward_kl',opd.teachers.top_k=16"
    assert compare_opd.parse_variant(spec) == (
        "dense",
        ["opd.objective='forward_kl'", "opd.teachers.top_k=16"],
    )
    assert compare_opd.slug("RL only") == "rl-only"


def test_the_plot_is_written(tmp_path):
    out = compare_opd.compare({"RL only": [_summary([0.1, 0.3], [0.2, 0.4], 60.0)]})
    compare_opd.plot(out, tmp_path / "eval_by_domain.png")
    assert (tmp_path / "eval_by_domain.png").stat().st_size > 10_000
