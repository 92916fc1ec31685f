"""``kvrt serve-http``: OpenAI's HTTP API over continuous-batching engines, one per model (see DESCRIPTION)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrt.bindings import FLASH_ATTN
from kvrt.errors import KvrtError

HELP = "serve models over HTTP with OpenAI's API (continuous batching, shared prompt prefixes)"
DESCRIPTION = """Serve one or more GGUF models over HTTP with OpenAI's API: /v1/models,
/v1/completions and /v1/chat/completions (streaming, n, logprobs, stop, seed, penalties,
JSON output through response_format). Any OpenAI client works: point its base URL at
http://HOST:PORT/v1. Each model gets one llama.cpp context whose sequences are decoded
together, one batch per step, so many requests share the machine; a prompt that starts
like an earlier one reuses that one's cached cells and only the rest is computed.
kvrt's own routes: /v1/kvrt/pins (keep a prefix cached), /v1/kvrt/fork (continue an
earlier completion), /v1/kvrt/stats. A model's name is its file name without .gguf.
Ctrl-C or SIGTERM stops the server."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n-gpu-layers", type=int, default=-1, help="layers to offload (-1: all)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per context (None: every core)")
    add_http_arguments(parser, http_default="127.0.0.1:8000")


def add_http_arguments(parser: argparse.ArgumentParser, *, http_default: str | None) -> None:
    """The HTTP mode's own options (``http_default=argparse.SUPPRESS``: ``--http`` optional, as in ``kvrt serve``)."""
    parser.add_argument("--http", metavar="HOST:PORT", default=http_default,
                        help="address to listen on (port 0: any free port)")
    parser.add_argument("--model", metavar="PATH", action="append", default=argparse.SUPPRESS,
                        help="a GGUF file to serve; repeat for several models (none given: the demo model)")
    parser.add_argument("--n-ctx", type=int, default=4096,
                        help="token cells per model, shared by all its requests (prompt and output)")
    parser.add_argument("--slots", type=int, default=8, help="requests (or choices) decoded together per model")
    parser.add_argument("--n-batch", type=int, default=512, help="most tokens computed in one step")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="most prompt tokens one request computes per step, so long prompts do not stall others")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting per model before new ones get HTTP 503")
    parser.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="auto", help="llama.cpp flash attention")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="output tokens for chat requests that set no max_tokens (capped by what fits)")
    parser.add_argument("--request-timeout-s", type=float, default=argparse.SUPPRESS,
                        help="end any request after this many seconds, finish_reason 'deadline' (none: no limit)")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) as a host and a port number."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise KvrtError(f"--http wants HOST:PORT (e.g. 127.0.0.1:8000), got {text!r}")
    return host, int(port)


def run(args: argparse.Namespace) -> int:
    from kvrt.engine.batching import Engine, EngineConfig
    from kvrt.engine.model import Model
    from kvrt.modelfiles.demo_model import demo_model_path
    from kvrt.serve.openai_server import OpenAIServer

    host, port = parse_address(args.http)
    paths = [Path(p) for p in getattr(args, "model", None) or [demo_model_path()]]
    names = [p.stem for p in paths]
    if len(set(names)) != len(names):
        raise KvrtError(f"two models would share a name (the file stem): {names}")
    config = EngineConfig(n_ctx=args.n_ctx, n_seq_max=args.slots, n_batch=args.n_batch,
                          prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, n_threads=args.threads,
                          flash_attn=args.flash_attn)
    models: list[Model] = []
    engines: dict[str, Engine] = {}
    try:
        for name, path in zip(names, paths):
            models.append(Model(path, n_gpu_layers=args.n_gpu_layers))
            engines[name] = Engine(models[-1], config)
        server = OpenAIServer(engines, default_max_tokens=args.max_tokens,
                              request_timeout_s=getattr(args, "request_timeout_s", None))
        print(f"kvrt serve-http: http://{host}:{port}/v1 serving {', '.join(engines)} "
              f"({config.n_seq_max} slots, {config.n_ctx} cells each)", flush=True)
        server.run(host, port)
    finally:
        for engine in engines.values():
            engine.close()
        for model in models:
            model.close()
    return 0
