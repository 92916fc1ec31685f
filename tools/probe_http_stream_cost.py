#!/usr/bin/env python3
"""How much CPU does kvrt's HTTP front spend on one streamed completion, thread by thread? (issue 24)

The engine's worker and the HTTP front's event loop share one interpreter. Every streamed token costs the
loop's thread a wake-up, a chunk and a socket write while it holds the GIL, and a step that streams a token
to each of N agents hands it that work N times; meanwhile the worker waits for the GIL whenever it let it
go (a llama.cpp call, a large NumPy operation). This probe measures the front's share on its own: kvrt's
OpenAI server runs in this process over a small engine, a client process sends ``--requests`` completions
one after another (token-id prompts of ``--prompt-tokens`` that share all but their last token, greedy,
``--max-tokens`` each, streamed unless ``--no-stream``), and each of this process's threads reports the CPU
time it spent, per request (from ``/proc``, Linux). The engine's own decode is in its worker's row; what
grows with ``--max-tokens`` in the ``kvrt-http`` row is the front's cost per streamed token.
Usage: probe_http_stream_cost.py [--model GGUF] [--prompt-tokens 4160] [--max-tokens 64] [--requests 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvrt.engine.model import Model
from kvrt.modelfiles.testmodels import write_model
from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.serve.openai_server import OpenAIServer

CLIENT = """
import http.client, json, sys
host, port, n, prompt_tokens, max_tokens, stream = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:7])
base = [10 + i % 150 for i in range(prompt_tokens)]
for i in range(n + 1):  # the first warms the prefix cache and is not counted
    body = {"model": "m", "prompt": base[:-1] + [10 + i % 150], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": bool(stream)}
    connection = http.client.HTTPConnection(host, port, timeout=600)
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    assert response.status == 200, data[:300]
    connection.close()
    if i == 0:
        print("warm", flush=True)
        sys.stdin.readline()  # the server side reads its counters before the counted requests
"""


def thread_cpu_s() -> dict[str, float]:
    """Each live thread of this process (by name): its user + system CPU seconds so far."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for thread in threading.enumerate():
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        times[thread.name] = (int(fields[11]) + int(fields[12])) / tick
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF (default: the generated tiny test model)")
    parser.add_argument("--prompt-tokens", type=int, default=4160)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--no-stream", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or write_model(Path(tmp) / "tiny.gguf", "tiny")
        engine = Engine(Model(path), EngineConfig(n_ctx=2 * (args.prompt_tokens + args.max_tokens), n_seq_max=2,
                                                  n_batch=512, flash_attn="off"))
        server = OpenAIServer({"m": engine})
        host, port = server.start("127.0.0.1", 0)
        try:
            client = subprocess.Popen([sys.executable, "-c", CLIENT, host, str(port), str(args.requests),
                                       str(args.prompt_tokens), str(args.max_tokens), str(int(not args.no_stream))],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert client.stdin is not None and client.stdout is not None
            client.stdout.readline()  # warm
            before, t0 = thread_cpu_s(), time.perf_counter()
            client.stdin.write("\n")
            client.stdin.flush()
            if client.wait() != 0:
                raise SystemExit("the client failed")
            wall, after = time.perf_counter() - t0, thread_cpu_s()
        finally:
            server.stop()
            engine.close()
    print(f"{args.requests} requests of {args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens, "
          f"{'not ' if args.no_stream else ''}streamed: {wall / args.requests * 1e3:.1f} ms each (wall)")
    for name in sorted(after, key=lambda n: before.get(n, 0.0) - after[n]):
        spent = after[name] - before.get(name, 0.0)
        if spent > 0:
            print(f"  {name}: {spent / args.requests * 1e3:.2f} ms CPU a request")


if __name__ == "__main__":
    main()
