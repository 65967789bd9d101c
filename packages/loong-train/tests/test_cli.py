"""Bad input to ``loong-train run`` gets a clear error naming what is wrong (exit code 2)."""

import subprocess
import sys

import pytest
import ray

from loong_train.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_unknown_recipe_lists_shipped_ones(capsys):
    code, err = _run(capsys, "run", "no-such-recipe")
    assert code == 2
    assert "unknown recipe 'no-such-recipe'" in err and "tiny-calc-agent" in err


def test_bad_toml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[train]\nsteps = = 3\n')
    code, err = _run(capsys, "run", str(bad))
    assert code == 2
    assert "bad.toml" in err and "line 3" in err


def test_wrong_type_names_the_key_and_expected_type(capsys):
    code, err = _run(capsys, "run", "tiny-calc-agent", "--set", "train.lr=fast")
    assert code == 2
    assert "train.lr" in err and "float" in err


def test_unknown_key_names_it_and_the_valid_ones(capsys):
    code, err = _run(capsys, "run", "tiny-calc-agent", "--set", "train.max_stalenes=2")
    assert code == 2
    assert "train.max_stalenes" in err and "max_staleness" in err


def test_invalid_value_is_refused(capsys):
    code, err = _run(capsys, "run", "tiny-calc-agent", "--set", "train.max_staleness=-1")
    assert code == 2
    assert "max_staleness must be >= 0" in err


def test_missing_recipe_file(capsys):
    code, err = _run(capsys, "run", "nowhere/recipe.toml")
    assert code == 2 and "does not exist" in err


@pytest.mark.integration
def test_console_script_reports_errors_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "loong_train.cli", "run", "tiny-calc-agent", "--set", "seed=abc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "seed" in proc.stderr and "int" in proc.stderr and "Traceback" not in proc.stderr


def test_address_flag_sets_the_ray_address(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        "loong_train.controller.run", lambda recipe, out, cache, resume: seen.setdefault("r", recipe) and out
    )
    assert main(["run", "tiny-calc-agent", "--address", "10.0.0.5:6379", "--set", "train.steps=1"]) == 0
    assert seen["r"].ray_address == "10.0.0.5:6379" and seen["r"].train.steps == 1


def test_resume_needs_a_checkpoint(tmp_path, capsys):
    fast = ["--set", "warmstart.steps=0", "--cache", str(tmp_path / "cache")]
    up = ray.is_initialized()  # left up by an earlier test in this process: no Ray is begun then
    code, err = _run(capsys, "run", "tiny-calc-agent", "--resume", str(tmp_path / "run"), *fast)
    assert code == 2 and "no checkpoint" in err
    assert ray.is_initialized() == up  # the Ray it began starting beside the checks is stopped
    code, err = _run(capsys, "run", "tiny-calc-agent", "--resume", "runs/a", "--out", "runs/b")
    assert code == 2 and "--resume DIR continues in DIR" in err


def test_sigterm_runs_the_clean_up(tmp_path):
    """A run stopped by SIGTERM still leaves through its finally blocks (where the controller shuts
    Ray down and unlinks TransferMesh's shared memory): checked on a real process."""
    import signal
    import subprocess
    import sys
    import textwrap

    marker = tmp_path / "cleaned"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from loong_train.cli import exit_on_sigterm
                exit_on_sigterm()
                try:
                    print("ready", flush=True)
                    time.sleep(60)
                finally:
                    open({str(marker)!r}, "w").write("yes")
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 143
    assert marker.read_text() == "yes"
