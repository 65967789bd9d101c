"""``loong-train``: run a recipe.

loong-train run tiny-calc-agent [--out runs/NAME] [--set train.steps=50]...
loong-train run tiny-calc-agent --resume runs/NAME [--set train.steps=200]...
loong-train recipes
loong-train serve-sglang MODEL_DIR [--port 30000] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from loong_train.ray_env import close as close_ray
from loong_train.ray_env import connect_in_background, prepare_local_ray

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loong-train", description="Loong: asynchronous RL for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train a recipe (a shipped name or a .toml path)")
    run.add_argument("recipe")
    run.add_argument("--out", type=Path, help="run directory (default: runs/<recipe name>)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set train.steps=50 (repeatable)",
    )
    run.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the run directory DIR from its newest checkpoint (DIR/checkpoints/step_<v>); "
        "the recipe and --set overrides are the ones it continues with (e.g. --set train.steps=200 "
        "trains on); keys that change what it computes may not differ from the checkpoint's",
    )
    run.add_argument(
        "--address", help="join an existing Ray cluster (auto or HOST:PORT) instead of starting one"
    )
    run.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("LOONG_CACHE", Path.home() / ".cache/loong")),
        help="where built tiny models are cached (default: ~/.cache/loong or $LOONG_CACHE)",
    )
    sub.add_parser("recipes", help="list shipped recipes")
    sub.add_parser("serve-sglang", help="serve a model directory over SGLang's HTTP API (serve-sglang -h)")
    build = sub.add_parser("build-tiny", help="build (and warm-start) a recipe's tiny model into a directory")
    build.add_argument("recipe")
    build.add_argument("--out", type=Path, required=True)
    build.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``kill``, a scheduler's timeout) into ``SystemExit(143)``, so the run's clean-up
    still happens: Ray actors are shut down and TransferMesh's shared memory is unlinked."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-sglang"]:
        from loong_train.engines.embedded.http_app import main as serve_sglang

        return serve_sglang(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from loong_core.config import ConfigError
    from loong_train.config import load_recipe, recipe_names

    if args.command == "recipes":
        print("\n".join(recipe_names()))
        return 0
    overrides = list(args.overrides)
    if getattr(args, "address", None):
        overrides.append(f'ray_address="{args.address}"')
    try:
        recipe = load_recipe(args.recipe, overrides)
    except ConfigError as e:
        print(f"loong-train: {e}", file=sys.stderr)
        return 2
    if args.command == "build-tiny":
        from loong_train import plugins

        print(plugins.model_builder().build(recipe, args.out))
        return 0
    if args.resume and args.out and args.out.absolute() != args.resume.absolute():
        print("loong-train: --resume DIR continues in DIR; drop --out", file=sys.stderr)
        return 2
    exit_on_sigterm()
    if not recipe.ray_address:
        prepare_local_ray()
    connect_in_background(recipe)  # Ray starts while the controller imports and checks the model
    try:
        from loong_train.controller import run

        out = run(
            recipe, args.resume or args.out or Path("runs") / recipe.name, args.cache, args.resume is not None
        )
    except ConfigError as e:  # --resume: no checkpoint, or a recipe that does not fit it
        print(f"loong-train: {e}", file=sys.stderr)
        return 2
    finally:
        close_ray()
    print(f"run directory: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
