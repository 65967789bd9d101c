"""Install each Loong package's wheel alone in a fresh venv, import all of it, and check what got imported.

This enforces the dependency direction of docs/architecture.md ("Packages and layers") on the *built artefacts*, which import-linter
cannot: a package that works in the workspace venv may still forget a dependency in its pyproject, ship
without a module, or drag a heavy stack (torch, ray) into a light package through a transitive import.

For every selected package NAME:

1. ``uv build --wheel --package NAME`` for NAME and its workspace (``loong-*``) dependencies;
2. ``uv venv`` a fresh environment and ``uv pip install`` the wheel plus its workspace wheels (third-party
   dependencies come from the index, pinned to ``uv.lock`` unless ``--unpinned``; uv's cache makes repeat
   installs of torch hard links, so this stays fast);
3. in that venv (``python -I``, so neither the workspace nor PYTHONPATH leak in), import ``loong_<name>``
   and every submodule, skipping lazily imported GPU backends (``--lazy`` patterns);
4. assert that no forbidden module is in ``sys.modules`` and name the first module that pulled one in,
   and that importing printed nothing to stderr (a clean import: no warning about a missing dependency);
5. run every code block of the package README fenced as ```` ```python example ```` as a script in that
   venv: the README's examples work with nothing but the package installed.

Usage::

    python tools/check_isolation.py                       # all five packages
    python tools/check_isolation.py --packages loong-core,loong-teacher --keep

Prints ``ok loong-core (N modules, 0 forbidden imports) [1.2s]`` per package; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("loong-core", "loong-agentflow", "loong-transfermesh", "loong-teacher", "loong-train")
MIDDLE = ("loong-agentflow", "loong-transfermesh", "loong-teacher")
DEFAULT_LAZY = ("*.sglang*", "*.megatron*", "*nccl*", "*cuda_ipc*")


def module_name(package: str) -> str:
    return package.replace("-", "_")


def forbidden_modules(package: str) -> tuple[str, ...]:
    """Top-level modules that must not be imported by importing ``package`` (docs/architecture.md)."""
    if package == "loong-core":
        return ("torch", "ray", "numpy", "transformers", *map(module_name, PACKAGES[1:]))
    if package in MIDDLE:
        siblings = [module_name(p) for p in MIDDLE if p != package]
        return ("ray", "loong_train", *siblings)
    return ()


# The probe runs inside the fresh venv. argv[1] is a JSON object {module, lazy, forbidden}; the last
# stdout line is a JSON report. Each module is imported by hand (not pkgutil.walk_packages) so that a lazy
# package is never imported just to walk into it.
PROBE = r"""
import fnmatch, importlib, json, pkgutil, sys, traceback
cfg = json.loads(sys.argv[1])
lazy, forbidden = cfg["lazy"], cfg["forbidden"]
report = {"imported": [], "skipped": [], "errors": {}, "culprits": {}, "file": None}

def loaded():
    return {name for name in forbidden if name in sys.modules}

def visit(name):
    if name != cfg["module"] and any(fnmatch.fnmatchcase(name, pat) for pat in lazy):
        report["skipped"].append(name)
        return
    before = loaded()
    try:
        module = importlib.import_module(name)
    except Exception:
        report["errors"][name] = traceback.format_exc()
        return
    report["imported"].append(name)
    for new in sorted(loaded() - before):
        report["culprits"][new] = name
    for info in pkgutil.iter_modules(getattr(module, "__path__", []), name + "."):
        visit(info.name)

visit(cfg["module"])
top = sys.modules.get(cfg["module"])
report["file"] = getattr(top, "__file__", None)
print(json.dumps(report))
"""


@dataclass
class Result:
    package: str
    ok: bool
    summary: str
    seconds: float


# ------------------------------------------------------------------------------------------ plumbing


def run(cmd: Sequence[str | pathlib.Path], cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` capturing output; the caller decides what a non-zero exit means."""
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, check=False)


def tail(text: str, lines: int = 25) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


def workspace_deps(package: str) -> list[str]:
    """Direct ``loong-*`` dependencies declared in ``packages/<package>/pyproject.toml``."""
    pyproject = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    names = [re.split(r"[\s\[<>=!~;@]", req, maxsplit=1)[0] for req in pyproject["project"]["dependencies"]]
    return [name.lower().replace("_", "-") for name in names if name.lower().replace("_", "-") in PACKAGES]


def closure(package: str) -> list[str]:
    """``package`` and all its workspace dependencies, dependencies first."""
    order: list[str] = []

    def visit(name: str) -> None:
        for dep in workspace_deps(name):
            visit(dep)
        if name not in order:
            order.append(name)

    visit(package)
    return order


# ------------------------------------------------------------------------------------------- stages


def build_wheels(packages: Sequence[str], out: pathlib.Path) -> dict[str, pathlib.Path | str]:
    """Build each wheel into ``out``; maps a package to its wheel path, or to an error message."""
    wheels: dict[str, pathlib.Path | str] = {}
    for package in packages:
        proc = run(["uv", "build", "--wheel", "--package", package, "-o", out])
        found = sorted(out.glob(f"{module_name(package)}-*.whl"))
        if proc.returncode != 0 or not found:
            wheels[package] = f"wheel build failed:\n{tail(proc.stderr + proc.stdout)}"
        else:
            wheels[package] = found[-1]
    return wheels


def lock_constraints(out: pathlib.Path) -> pathlib.Path:
    """Export the pinned third-party versions of ``uv.lock`` as a constraints file (lock is not changed)."""
    path = out / "constraints.txt"
    cmd = ["uv", "export", "--frozen", "--no-hashes", "--all-packages", "--no-emit-workspace"]
    proc = run([*cmd, "--no-header", "-o", path])
    if proc.returncode != 0:
        sys.exit(f"could not export constraints from uv.lock:\n{tail(proc.stderr)}")
    return path


def install(
    venv: pathlib.Path, python: str, wheels: Sequence[pathlib.Path], constraints: pathlib.Path | None
) -> str | None:
    """Create ``venv`` and install ``wheels`` into it; returns an error message or None."""
    proc = run(["uv", "venv", venv, "--python", python, "--quiet"], cwd=venv.parent)
    if proc.returncode != 0:
        return f"uv venv failed:\n{tail(proc.stderr)}"
    cmd: list[str | pathlib.Path] = ["uv", "pip", "install", "--python", venv / "bin" / "python", *wheels]
    if constraints is not None:
        cmd += ["--constraint", constraints]
    proc = run(cmd, cwd=venv.parent)
    return None if proc.returncode == 0 else f"install failed:\n{tail(proc.stderr)}"


def probe(venv: pathlib.Path, package: str, lazy: Sequence[str]) -> dict | str:
    """Import the package and its submodules inside ``venv``; the probe's report or an error message."""
    cfg = {"module": module_name(package), "lazy": list(lazy), "forbidden": list(forbidden_modules(package))}
    proc = run([venv / "bin" / "python", "-I", "-c", PROBE, json.dumps(cfg)], cwd=venv.parent)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return f"import probe crashed (exit {proc.returncode}):\n{tail(proc.stderr + proc.stdout)}"
    return json.loads(lines[-1]) | {"stderr": proc.stderr}


def judge(package: str, venv: pathlib.Path, report: dict) -> tuple[bool, str]:
    """Turn a probe report into (ok, message)."""
    problems = [f"could not import {name}:\n{tail(tb)}" for name, tb in report["errors"].items()]
    if report["file"] and not pathlib.Path(report["file"]).resolve().is_relative_to(venv.resolve()):
        problems.append(f"{module_name(package)} was imported from {report['file']}, not from the fresh venv")
    for mod, via in sorted(report["culprits"].items()):
        problems.append(f"forbidden import {mod!r} (first pulled in by {via})")
    if report["stderr"].strip():
        problems.append(
            f"importing printed to stderr (an import should be silent):\n{tail(report['stderr'])}"
        )
    n, n_bad = len(report["imported"]), len(report["culprits"])
    skipped = f", {len(report['skipped'])} lazy skipped" if report["skipped"] else ""
    if problems:
        return False, f"{package} ({n} modules, {n_bad} forbidden imports{skipped}):\n  " + "\n  ".join(
            problems
        )
    return True, f"{package} ({n} modules, 0 forbidden imports{skipped})"


def check_package(
    package: str,
    wheels: dict[str, pathlib.Path | str],
    work: pathlib.Path,
    args: argparse.Namespace,
    constraints: pathlib.Path | None,
) -> Result:
    start = time.perf_counter()
    needed = [wheels[name] for name in closure(package)]
    errors = [w for w in needed if isinstance(w, str)]
    if errors:
        return Result(package, False, f"{package}: {errors[0]}", time.perf_counter() - start)
    venv = work / f"venv-{package}"
    error = install(venv, args.python, [w for w in needed if isinstance(w, pathlib.Path)], constraints)
    report = error if error is not None else probe(venv, package, args.lazy)
    if isinstance(report, str):
        return Result(package, False, f"{package}: {report}", time.perf_counter() - start)
    ok, summary = judge(package, venv, report)
    if ok and (failure := run_examples(venv, package)):
        ok, summary = False, f"{package}: {failure}"
    return Result(package, ok, summary, time.perf_counter() - start)


def run_examples(venv: pathlib.Path, package: str) -> str | None:
    """Run the README's ```python example blocks in ``venv``; an error message or None."""
    readme = (ROOT / "packages" / package / "README.md").read_text()
    for i, code in enumerate(re.findall(r"```python example\n(.*?)```", readme, re.S)):
        script = venv.parent / f"{package}-example-{i}.py"
        script.write_text(code)
        proc = run([venv / "bin" / "python", "-I", script], cwd=venv.parent)
        if proc.returncode != 0:
            return f"README example {i} failed (exit {proc.returncode}):\n{tail(proc.stderr + proc.stdout)}"
    return None


# ----------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", default=",".join(PACKAGES), help="comma-separated subset to check")
    parser.add_argument("--keep", action="store_true", help="keep the temporary wheels and venvs")
    parser.add_argument("--python", default="3.11", help="interpreter request for `uv venv` (default 3.11)")
    parser.add_argument(
        "--lazy",
        action="append",
        default=list(DEFAULT_LAZY),
        help="fnmatch pattern of submodules not to import (repeatable); defaults: " + " ".join(DEFAULT_LAZY),
    )
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="resolve third-party deps freely instead of pinning to uv.lock",
    )
    args = parser.parse_args(argv)
    args.packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    unknown = sorted(set(args.packages) - set(PACKAGES))
    if unknown:
        parser.error(f"unknown package(s) {', '.join(unknown)}; choose from {', '.join(PACKAGES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("uv") is None:
        sys.exit("uv is not on PATH")
    work = pathlib.Path(tempfile.mkdtemp(prefix="loong-isolation-"))
    try:
        start = time.perf_counter()
        needed = [name for name in PACKAGES if any(name in closure(p) for p in args.packages)]
        wheels = build_wheels(needed, work / "wheels")
        print(f"built {len(needed)} wheel(s) in {time.perf_counter() - start:.1f}s", flush=True)
        constraints = None if args.unpinned else lock_constraints(work)
        results = []
        for package in args.packages:
            result = check_package(package, wheels, work, args, constraints)
            print(f"{'ok' if result.ok else 'FAIL'} {result.summary} [{result.seconds:.1f}s]", flush=True)
            results.append(result)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    failed = [r.package for r in results if not r.ok]
    if failed:
        print(f"isolation check failed for: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"isolation ok for {len(results)} package(s) in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
