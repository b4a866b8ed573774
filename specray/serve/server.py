"""`specray serve`: the engine's flags plus the server's, uvicorn in the foreground.

The HTTP server comes up first and answers ``/health`` with 503 while the engine starts in a
worker thread; a start-up failure stops the server and becomes the command's exit status.
"""

from __future__ import annotations

import argparse
import sys

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    g.add_argument("--max-num-queued-reqs", type=int, default=256,
                   help="engine requests that may wait beyond the --max-num-seqs running ones; more get 503")
    g.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes")
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="uvicorn's log level")


def serve_config_from_args(args: argparse.Namespace, max_num_seqs: int):
    from specray.serve.app import ServeConfig

    if not 0 <= args.port <= 65535:
        raise ValueError(f"port ({args.port}) must be in [0, 65535]")
    return ServeConfig(served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                       max_num_seqs=max_num_seqs, max_num_queued_reqs=args.max_num_queued_reqs)


def serve(engine_config, args: argparse.Namespace) -> int:
    """Serve ``engine_config`` with the server flags of ``args`` until interrupted."""
    import uvicorn

    from specray.launch import resolve_launcher
    from specray.serve.app import EngineHolder, build_app

    if resolve_launcher(engine_config) == "external":
        raise ValueError("specray serve runs the server on one process and starts the ranks itself; pass "
                         "--launcher mp or ray (under torchrun, use `specray generate`)")
    config = serve_config_from_args(args, engine_config.max_num_seqs)
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def build_engine():
        from specray.async_llm import AsyncLLM

        engine = AsyncLLM(engine_config)
        print(f"specray serve: {config.served_model_name!r} ready on http://{args.host}:{args.port}", flush=True)
        return engine

    def on_failure(err: BaseException) -> None:
        failures.append(err)
        server.should_exit = True

    holder = EngineHolder(build_engine, on_failure)
    server = uvicorn.Server(uvicorn.Config(build_app(holder, config), host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # Ctrl-C (SIGINT) is how a server is stopped, not an error
    finally:
        if holder.engine is not None:  # lifespan shutdown closes it, unless the interrupt cut that short
            holder.engine.close()
    if failures:
        if isinstance(failures[0], ValueError):
            raise failures[0]
        print(f"error: the engine failed to start: {type(failures[0]).__name__}: {failures[0]}", file=sys.stderr)
        return 1
    return 0
