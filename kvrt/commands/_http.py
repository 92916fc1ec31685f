"""``kvrt serve --http``: OpenAI's HTTP API over continuous-batching engines, one per model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvrt.accounting.budget import host_ram_bytes
from kvrt.bindings import FLASH_ATTN
from kvrt.commands._args import non_negative_int, positive_int, seconds
from kvrt.errors import KvrtError

if TYPE_CHECKING:  # the serve extra's imports wait until --http is used
    from kvrt.runtime.admission import EngineConfig
    from kvrt.serve.http_front import HttpFront
    from kvrt.serve.registry import ModelRegistry

DESCRIPTION = """With --http HOST:PORT, serve one or more GGUF models over HTTP with OpenAI's
API: /v1/models, /v1/completions, /v1/responses and /v1/chat/completions (streaming, n, logprobs, stop, seed,
penalties, JSON output through response_format, tools and tool_choice: calls parsed from the output,
forced ones constrained to their schemas). Any OpenAI client or agent framework works: point its base URL
at http://HOST:PORT/v1. Each model gets one llama.cpp context whose sequences are decoded
together, one batch per step, so many requests share the machine; a prompt that starts like an
earlier one reuses that one's cached cells and only the rest is computed. kvrt's own routes:
/v1/kvrt/pins (keep a prefix cached), /v1/kvrt/fork (continue an earlier completion),
/v1/kvrt/stats; a request names its agent by the X-Kvrt-Agent header or OpenAI's user field, and an agent's
history is kept between its turns (with --state-dir, in DIR/http: saved before each turn is answered and
restored after a restart); operators get /health (open even with --api-key), /metrics (Prometheus),
/tokenize and /detokenize. A model's name is its file name without .gguf. With --models-dir every GGUF there
is listed (loaded or not) and loaded on a request's demand, the least recently used idle models unloaded to make
room in the ledger (HTTP 507 with the ledger's numbers when even that is not enough); POST
/v1/kvrt/models/NAME/load and /unload (409 while requests use it) do it by hand. Every option can
also be set by the environment variable named beside it (KVRT_<OPTION>); the command line wins."""


HOST_MIB_DEFAULT = 8192  # llama-server's --cache-ram default: host memory for prompts evicted from its slots


def default_host_mib() -> int:
    """The host tier's default size: llama-server's :data:`HOST_MIB_DEFAULT`, at most an eighth of the RAM
    (it is reserved, and pinned on a GPU machine, when the model loads)."""
    return min(HOST_MIB_DEFAULT, host_ram_bytes() // 8 >> 20)


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP front's options (``--http`` itself is added by the caller)."""
    group = parser.add_argument_group("HTTP front (--http)")
    group.add_argument("--model", metavar="PATH", action="append", default=argparse.SUPPRESS,
                       help="a GGUF file to serve, loaded at start; repeat for several models (none given and no "
                            "--models-dir: the demo model)")
    group.add_argument("--models-dir", metavar="DIR", default=None,
                       help="serve every *.gguf in DIR too, loaded on first request; idle models are unloaded, least "
                            "recently used first, when another needs the room")
    group.add_argument("--n-ctx", type=positive_int, default=4096,
                       help="token cells per model for all its requests (prompt and output), laid out by --kv-layout")
    group.add_argument("--slots", type=positive_int, default=8, help="requests (or choices) decoded together per model")
    group.add_argument("--n-batch", type=positive_int, default=512, help="most tokens computed in one step")
    group.add_argument("--prefill-chunk", type=positive_int, default=256,
                       help="most prompt tokens one request computes per step, so long prompts do not stall others")
    group.add_argument("--host-mib", type=non_negative_int, default=default_host_mib(),
                       help="host memory per model, reserved at start (pinned on a GPU machine), for copies of "
                            "conversations evicted from its context, restored when they return instead of prefilled "
                            "again (0: recompute them; default: llama-server's --cache-ram, 8192, at most an eighth "
                            "of this machine's RAM: %(default)s here)")
    group.add_argument("--max-queue", type=positive_int, default=64,
                       help="requests waiting per model before new ones get HTTP 503")
    group.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="auto", help="llama.cpp flash attention")
    group.add_argument("--max-tokens", type=positive_int, default=512,
                       help="output tokens for chat requests that set no max_tokens (capped by what fits)")
    group.add_argument("--max-input-bytes", type=positive_int, default=4 << 20,
                       help="largest request body in bytes; larger ones get HTTP 413 before they are read whole")
    group.add_argument("--api-key", metavar="KEY", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (none: no key needed)")
    group.add_argument("--sse-keepalive-s", type=seconds(zero=False), default=15.0,
                       help="send a streamed request an SSE comment (': keep-alive') after this many seconds without "
                            "output: while it waits in the queue or for its first token, so proxies keep it open")
    group.add_argument("--exact-prefix", action="store_true",
                       help="every request (and pin) that sets no exact_prefix of its own gets exact_prefix: its "
                            "prompt's logits are those of a cold evaluation of the same prompt, bit for bit: a cached "
                            "prefix is reused only in whole prefill units computed alone, and the rest is prefilled "
                            "in steps of its own (the others wait those steps); exact in the split KV layout")
    group.add_argument("--context-policy", choices=("refuse", "shift"), default="refuse",
                       help="a prompt longer than a request's cells: refuse it (HTTP 400 naming the limit), or shift "
                            "it: keep the first --keep-tokens tokens and the most recent ones, drop the middle (the "
                            "answer says so: header X-Kvrt-Context-Shift, and a kvrt.context_shift field unstreamed)")
    group.add_argument("--keep-tokens", type=non_negative_int, default=1,
                       help="with --context-policy shift: the prompt's first tokens always kept (1: a BOS)")
    group.add_argument("--replicas", type=positive_int, default=1,
                       help="with --devices: load each model on up to this many devices (a copy of its weights and "
                            "an engine each, only on devices that hold a whole copy); a request goes to the copy "
                            "holding the longest prefix of its prompt (an agent's history), else the least loaded")
    group.add_argument("--step-trace", metavar="DIR", default=None,
                       help="write a line of JSON per engine step to DIR/MODEL.jsonl: the batch's decode rows, prompt "
                            "chunks, llama.cpp micro-batches and each phase's milliseconds (kvrt.runtime.step_trace; "
                            "tools/step_trace_summary.py sums a file up; a replica's is DIR/MODEL@DEVICE.jsonl)")
    group.add_argument("--request-timeout-s", type=seconds(zero=False), default=argparse.SUPPRESS,
                       help="end any request after this many seconds, finish_reason 'deadline' (none: no limit)")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) as a host and a port number."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise KvrtError(f"--http wants HOST:PORT (e.g. 127.0.0.1:8000), got {text!r}")
    return host, int(port)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` every engine of ``kvrt serve --http`` gets, from its parsed options; one place,
    so a tool that runs the engine without the front (``tools/probe_engine_alone.py``) gets the very same one."""
    from kvrt.runtime.admission import EngineConfig

    return EngineConfig(n_ctx=args.n_ctx, n_seq_max=args.slots, n_batch=args.n_batch,
                        prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, n_threads=args.threads,
                        flash_attn=args.flash_attn, host_bytes=args.host_mib << 20, kv_layout=args.kv_layout,
                        pad_gaps=getattr(args, "pad_gaps", "on") == "on",
                        even_chunks=getattr(args, "even_chunks", "on") == "on",
                        decode_wait_s=getattr(args, "decode_wait_s", EngineConfig.decode_wait_s),
                        hold_s=getattr(args, "hold_s", EngineConfig.hold_s),
                        backend_sampling=getattr(args, "backend_sampling", "off") == "on",
                        host_write_behind=getattr(args, "host_write_behind", "on") == "on",
                        warmup=getattr(args, "warmup", EngineConfig.warmup))


def start_http(args: argparse.Namespace, registry: ModelRegistry) -> HttpFront:
    """Start ``kvrt serve --http``'s front from its parsed options (see :func:`kvrt.serve.http_front.start_front`:
    every ``--model`` loaded through ``registry``'s ledger, ``--models-dir``'s listed for loading on demand)."""
    from kvrt.serve.http_front import HttpOptions, start_front

    host, port = parse_address(args.http)
    config = engine_config(args)
    state_dir = getattr(args, "state_dir", None)
    options = HttpOptions(models=tuple(Path(p) for p in getattr(args, "model", None) or ()),
                          models_dir=Path(args.models_dir) if getattr(args, "models_dir", None) else None,
                          state_dir=Path(state_dir) if state_dir is not None else None, max_tokens=args.max_tokens,
                          request_timeout_s=getattr(args, "request_timeout_s", None),
                          max_input_bytes=args.max_input_bytes, api_key=args.api_key,
                          sse_keepalive_s=args.sse_keepalive_s, exact_prefix=args.exact_prefix,
                          context_policy=args.context_policy, keep_tokens=args.keep_tokens,
                          replicas=getattr(args, "replicas", 1),
                          step_trace=Path(args.step_trace) if getattr(args, "step_trace", None) else None)
    return start_front(options, config, registry, host, port)
