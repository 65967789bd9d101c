"""SGLang's native HTTP API, served by the embedded engine, so SGLang clients run on CPU.

The subset Loong uses, with SGLang's field names and shapes (``entrypoints/http_server.py`` and
``managers/io_struct.py`` in sgl-project/sglang), as the Structs of ``loong_core.sglang_api``
(bodies are decoded with msgspec, :mod:`.wire`); requests carry token ids, responses carry
``output_ids`` and ``meta_info`` as SGLang does when started with ``--skip-tokenizer-init``.
This is the stand-in for SGLang on CPU (``loong-train serve-sglang``); :mod:`loong_train.engines.sglang`
launches and supervises real SGLang servers instead. The routes, one module per job:

- ``POST /generate``: :mod:`.http_generate`;
- ``/pause_generation``, ``/continue_generation``, ``/get_weight_version``, ``/get_model_info``,
  ``/get_weights_by_name``, ``/flush_cache``, and the state every route shares:
  :mod:`.http_control`; ``/health`` and ``/health_generate`` answer 200;
- ``/update_weights_from_disk``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
  ``/update_weights_from_tensor``: :mod:`.http_weights`;
- with ``--enable-lora``: ``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter`` and
  ``/generate``'s ``lora_path``: :mod:`.http_lora`.

Errors: a bad field answers 400 with SGLang's error body (``object``, ``message``, ``type``,
``code``) plus ``param`` naming the field and ``success: false``. With an API key, every path but
``/health*`` needs ``Authorization: Bearer <key>`` (401 otherwise). Binds 127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import hmac
from pathlib import Path

import msgspec
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.engines.embedded.http_control import SGLangServer
from loong_train.engines.embedded.http_generate import GenerateRoutes
from loong_train.engines.embedded.http_lora import LoraRoutes
from loong_train.engines.embedded.http_weights import WeightRoutes
from loong_train.engines.embedded.wire import BadRequest, bad_request
from loong_train.memory import keep_freed_memory

__all__ = ["LoraOptions", "build_app", "main", "serve"]


class LoraOptions(msgspec.Struct, frozen=True):
    """SGLang's LoRA flags: ``--max-lora-rank`` (0: any) and ``--lora-target-modules`` (empty: any)."""

    max_rank: int = 0
    target_modules: tuple[str, ...] = ()


class _ApiKey:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every path but ``/health*``."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith("/health"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _ok(request: Request) -> Response:
    return Response(status_code=200)


async def _on_bad_request(request: Request, exc: BadRequest) -> Response:
    return bad_request(exc.param, str(exc).removeprefix(f"{exc.param}: "))


def build_app(
    engine: EmbeddedEngine,
    *,
    model_path: str = "",
    api_key: str | None = None,
    group_timeout_s: float = 600.0,
    incremental_streaming: bool = False,
    lora: LoraOptions | None = None,
):
    """The ASGI app serving ``engine`` (wrapped in API-key checking when ``api_key`` is set);
    ``app.state.sglang`` is its :class:`~.http_control.SGLangServer`. ``incremental_streaming``:
    streamed events carry only their new tokens (SGLang's ``--incremental-streaming-output``).
    ``lora``: serve LoRA adapters (SGLang's ``--enable-lora`` and its bounds)."""
    s = SGLangServer(engine, model_path, incremental_streaming)
    if lora is not None:
        s.lora = LoraRoutes(s, lora.max_rank, lora.target_modules)
    gen, weights = GenerateRoutes(s), WeightRoutes(s, group_timeout_s)
    routes = [
        Route("/generate", gen.generate, methods=["POST", "PUT"]),
        Route("/pause_generation", s.pause, methods=["POST"]),
        Route("/continue_generation", s.resume, methods=["POST"]),
        Route("/get_weight_version", s.weight_version, methods=["GET"]),
        Route("/get_model_info", s.model_info, methods=["GET"]),
        Route("/health", _ok, methods=["GET"]),
        Route("/health_generate", _ok, methods=["GET"]),
        Route("/flush_cache", s.flush_cache, methods=["GET", "POST"]),
        Route("/get_weights_by_name", s.weights_by_name, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", weights.from_disk, methods=["POST"]),
        Route("/init_weights_update_group", weights.init_group, methods=["POST"]),
        Route("/update_weights_from_distributed", weights.from_distributed, methods=["POST"]),
        Route("/destroy_weights_update_group", weights.destroy_group, methods=["POST"]),
        Route("/update_weights_from_tensor", weights.from_tensor, methods=["POST"]),
    ]
    if s.lora is not None:
        routes += [
            Route("/load_lora_adapter_from_tensors", s.lora.load, methods=["POST"]),
            Route("/unload_lora_adapter", s.lora.unload, methods=["POST"]),
        ]
    app = Starlette(routes=routes, exception_handlers={BadRequest: _on_bad_request})
    app.state.sglang = s
    return _ApiKey(app, api_key) if api_key else app


def serve(
    engine: EmbeddedEngine,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    model_path: str = "",
    incremental_streaming: bool = False,
    lora: LoraOptions | None = None,
) -> None:
    """Serve ``engine`` until interrupted."""
    import uvicorn

    app = build_app(
        engine, model_path=model_path, api_key=api_key, incremental_streaming=incremental_streaming, lora=lora
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")


def main(argv: list[str] | None = None) -> int:
    """``loong-train serve-sglang MODEL_DIR [--host] [--port] [--api-key] [--seed]``.

    ``--model-path MODEL_DIR`` works too (SGLang's spelling), so a supervisor launches this server
    and ``python -m sglang.launch_server`` with the same standard flags."""
    parser = argparse.ArgumentParser(prog="loong-train serve-sglang", description=__doc__.splitlines()[0])
    parser.add_argument(
        "model_dir", type=Path, nargs="?", help="Hugging Face directory (config.json + *.safetensors)"
    )
    parser.add_argument("--model-path", type=Path, help="the same, as SGLang's launcher spells it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run a checkpoint's own modeling code (auto_map)"
    )
    parser.add_argument(
        "--incremental-streaming-output",
        "--stream-output",
        action="store_true",
        help="streamed /generate events carry only their new output_ids and output logprobs "
        "(SGLang's flag, formerly --stream-output); default: the answer so far",
    )
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter_from_tensors)"
    )
    parser.add_argument("--max-lora-rank", type=int, default=0, help="the largest adapter rank (0: any)")
    parser.add_argument(
        "--lora-target-modules", nargs="*", default=[], help="the modules adapters may adapt (default: any)"
    )
    args = parser.parse_args(argv)
    if (args.model_dir is None) == (args.model_path is None):
        parser.error("give the model directory once: MODEL_DIR or --model-path MODEL_DIR")
    args.model_dir = args.model_dir or args.model_path
    from loong_train.models.auto import load_causal_lm

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    engine = EmbeddedEngine(load_causal_lm(args.model_dir, args.trust_remote_code), seed=args.seed)
    print(f"serve-sglang: {args.model_dir} on http://{args.host}:{args.port}", flush=True)
    lora = LoraOptions(args.max_lora_rank, tuple(args.lora_target_modules)) if args.enable_lora else None
    serve(
        engine,
        args.host,
        args.port,
        args.api_key,
        str(args.model_dir),
        args.incremental_streaming_output,
        lora,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
