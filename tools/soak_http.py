#!/usr/bin/env python3
"""Soak ``kvrt serve --http``: many concurrent clients, streams, disconnects, bad requests; SIGTERM at the end.

    nice -n 10 python tools/soak_http.py --duration-s 120 --clients 16 --out /tmp/soak-http.json

Starts ``kvrt serve --http 127.0.0.1:0`` (the demo model unless ``--model``) and runs
``--clients`` threads for ``--duration-s`` seconds, each on fresh connections: chat and
text completions plain and streamed, streams the client drops after a few chunks, and bad
requests (malformed JSON, missing or wrong-typed fields, an unknown model, an unimplemented
parameter, an unknown route) mixed in, plus /health, /v1/models and /metrics. Every reply
is checked: a good request must complete (2xx with a whole body, or a stream ending in
``[DONE]``) or be refused as overloaded (503); a bad one must be a 4xx whose JSON error
names what was wrong. The server's RSS and open file descriptors are sampled each second.
At the end, with ``--final-streams`` long streams still running, SIGTERM: the server must
exit 0 within ``--shutdown-timeout-s``, and each open stream must end (a final event and
``[DONE]``, or a closed connection), none hang. Prints a JSON summary (exit status 1 when a
check failed); the server's log, one line per request (``kvrt -v``), is named in it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _soak import Watch, report, run_clients

from kvrt.modelfiles.demo_model import demo_model_path
from kvrt.serve.results import percentiles

CLIENT_TIMEOUT_S = 120.0
FINAL_TOKENS = 400  # a final stream's length: within one slot's share of the default --n-ctx / --slots (512 cells)
WORDS = ("the", "agent", "reads", "a", "long", "document", "über", "naïve", "数据", "and", "then", "writes", "🙂")
# (path, body, the word the error must name): each must be answered 4xx with a JSON error naming it
BAD = [
    ("/v1/chat/completions", b"{not json", "JSON"),
    ("/v1/chat/completions", b'{"model": "M"}', "messages"),
    ("/v1/chat/completions", b'{"model": "M", "messages": "hi"}', "messages"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": -5}', "max_tokens"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": "5"}', "max_tokens"),
    ("/v1/completions", b'{"model": "no-such-model", "prompt": "hi"}', "no-such-model"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "mirostat": 2}', "mirostat"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "temperature": "hot"}', "temperature"),
    ("/v1/nothing-here", b"{}", "Not Found"),
]


@dataclass
class Tally:
    """Counts shared by the client threads (one lock; a sample of each kind of failure kept)."""

    counts: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)  # of the good requests answered whole
    errors: Counter[str] = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        with self.lock:
            self.counts.update(counts)

    def completed(self, started: float, tokens: int) -> None:
        with self.lock:
            self.counts.update(completed=1, tokens=tokens)
            self.latencies_s.append(time.monotonic() - started)

    def error(self, kind: str, detail: str) -> None:
        with self.lock:
            self.errors[kind] += 1
            self.samples.setdefault(kind, detail[:300])


def connect(port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)


def good_body(rng: random.Random, model: str, *, chat: bool, stream: bool, max_tokens: int) -> bytes:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "stream": stream,
                               "temperature": rng.choice([0, 0.7])}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return json.dumps(body).encode()


def read_stream(response: http.client.HTTPResponse, drop_after: int | None) -> tuple[int, bool, bool]:
    """(content chunks read, whether ``[DONE]`` came, whether an error event came); stops after ``drop_after``."""
    chunks, error = 0, False
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            return chunks, True, error
        event = json.loads(data)
        error = error or "error" in event
        chunks += bool(event.get("choices"))
        if drop_after is not None and chunks >= drop_after:
            return chunks, False, error
    return chunks, False, error


def good_request(port: int, rng: random.Random, model: str, tally: Tally) -> None:
    """One chat or text completion, plain, streamed, or streamed and dropped; counted and checked."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    drop_after = rng.randint(1, 4) if stream and rng.random() < 0.3 else None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    conn, started = connect(port), time.monotonic()
    try:
        conn.request("POST", path, good_body(rng, model, chat=chat, stream=stream, max_tokens=rng.randint(1, 24)),
                     {"Content-Type": "application/json"})
        tally.add(sent=1)
        response = conn.getresponse()
        if response.status == 503:
            response.read()
            tally.add(refused=1)
        elif response.status != 200:
            tally.error(f"good:{response.status}", response.read().decode("utf-8", "replace"))
        elif stream:
            chunks, done, error = read_stream(response, drop_after)
            if drop_after is not None and not done:
                tally.add(disconnected=1, tokens=chunks)
            elif done and not error:
                tally.completed(started, chunks)
            else:
                tally.error("stream:unfinished" if not done else "stream:error_event", f"{chunks} chunks")
        else:
            reply = json.loads(response.read())
            tally.completed(started, int(reply["usage"]["completion_tokens"]))
    except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
        tally.error(f"good:{type(exc).__name__}", str(exc))
    finally:
        conn.close()  # mid-stream for a dropped stream: the server must notice and free its slot


def bad_request(port: int, rng: random.Random, model: str, tally: Tally) -> None:
    path, body, named = rng.choice(BAD)
    conn = connect(port)
    try:
        conn.request("POST", path, body.replace(b'"M"', json.dumps(model).encode()),
                     {"Content-Type": "application/json"})
        tally.add(bad_sent=1)
        response = conn.getresponse()
        text = response.read().decode("utf-8", "replace")
        if 400 <= response.status < 500 and named in text:
            tally.add(bad_refused=1)
        else:
            tally.error(f"bad:{response.status}", f"{path} {body[:60]!r} -> {text}")
    except (OSError, http.client.HTTPException) as exc:
        tally.error(f"bad:{type(exc).__name__}", str(exc))
    finally:
        conn.close()


def probe(port: int, rng: random.Random, tally: Tally) -> None:
    path = rng.choice(["/health", "/v1/models", "/metrics"])
    conn = connect(port)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        if response.status == 200:
            tally.add(probes=1)
        else:
            tally.error(f"probe:{response.status}", path)
    except (OSError, http.client.HTTPException) as exc:
        tally.error(f"probe:{type(exc).__name__}", str(exc))
    finally:
        conn.close()


def client_loop(index: int, port: int, model: str, until: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed * 1000 + index)
    while time.monotonic() < until:
        pick = rng.random()
        if pick < 0.75:
            good_request(port, rng, model, tally)
        elif pick < 0.92:
            bad_request(port, rng, model, tally)
        else:
            probe(port, rng, tally)


def final_stream(port: int, model: str, outcomes: list[str], opened: threading.Semaphore) -> None:
    """A long stream open when SIGTERM comes; its outcome: ``done`` (final event + [DONE]), ``closed``, or
    ``refused`` (503: the server was already stopping)."""
    conn, streaming = connect(port), False
    try:
        conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": "Count: one, two,",
                                                            "max_tokens": FINAL_TOKENS, "stream": True,
                                                            "ignore_eos": True}).encode(),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            outcomes.append("refused" if response.status == 503 else f"status {response.status}")
            return
        opened.release()
        streaming = True
        _, done, _ = read_stream(response, None)
        outcomes.append("done" if done else "closed")
    except (OSError, http.client.HTTPException):
        outcomes.append("closed")
    finally:
        if not streaming:
            opened.release()
        conn.close()


def latency(values: list[float]) -> dict[str, float]:
    """Percentiles and maximum of the completed requests' latencies (s, submission to last byte)."""
    return {**{k: round(v, 3) for k, v in asdict(percentiles(values)).items()}, "max": round(max(values, default=0), 3)}


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[str], int, str]:
    with log.open("a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvrt.cli", "-v", "serve", "--http", "127.0.0.1:0",
                                 "--model", args.model, "--n-ctx", str(args.n_ctx), "--slots", str(args.slots),
                                 "--threads", str(args.threads), "--max-queue", str(args.max_queue),
                                 "--shutdown-timeout-s", str(args.shutdown_timeout_s)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    banner = proc.stdout.readline() if proc.stdout else ""
    found = re.search(r"http://127\.0\.0\.1:(\d+)/v1 serving (\S+)", banner)
    if not found:
        proc.kill()
        raise SystemExit(f"kvrt serve --http did not start: {banner!r}; see {log}")
    return proc, int(found.group(1)), found.group(2).rstrip(",")


def shutdown(proc: subprocess.Popen[str], port: int, model: str, streams: int,
             timeout_s: float) -> dict[str, object]:
    """Open ``streams`` long streams, SIGTERM, and how the server and the streams ended."""
    outcomes: list[str] = []
    opened = threading.Semaphore(0)
    threads = [threading.Thread(target=final_stream, args=(port, model, outcomes, opened)) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for _ in threads:
        opened.acquire(timeout=CLIENT_TIMEOUT_S)  # each is streaming (or already failed)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status: int | None = proc.wait(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = None
    seconds = time.monotonic() - t0
    for thread in threads:
        thread.join(CLIENT_TIMEOUT_S)
    hung = sum(thread.is_alive() for thread in threads)
    return {"exit_status": status, "seconds": round(seconds, 3), "bounded": seconds <= timeout_s,
            "open_streams": streams, "stream_outcomes": dict(Counter(outcomes)), "streams_hung": hung}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--model", default=str(demo_model_path()))
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads (on the 2-core VM, 2 beside 16 client threads stretched p99 to 46 s)")
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--final-streams", type=int, default=4, help="long streams open when SIGTERM comes")
    parser.add_argument("--shutdown-timeout-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="kvrt-soak-http-")) / "serve.log"
    proc, port, model = start_server(args, log)
    tally, watch = Tally(), Watch(proc.pid).start()
    print(f"soak-http: {args.clients} clients for {args.duration_s:g} s against pid {proc.pid} on port {port}",
          flush=True)
    elapsed = run_clients(lambda i, until: client_loop(i, port, model, until, args.seed, tally), args.clients,
                          args.duration_s)
    fds_before_sigterm = watch.fds[-1] if watch.fds else None
    end = shutdown(proc, port, model, args.final_streams, args.shutdown_timeout_s)
    watch.stop()
    counts = tally.counts
    summary = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "model": model, "clients": args.clients, "duration_s": round(elapsed, 1),
        "requests_sent": counts["sent"], "completed": counts["completed"], "refused_overloaded": counts["refused"],
        "disconnected_by_client": counts["disconnected"], "tokens": counts["tokens"],
        "bad_requests_sent": counts["bad_sent"], "bad_requests_refused_by_name": counts["bad_refused"],
        "probes": counts["probes"], "latency_s": latency(tally.latencies_s),
        "errors": dict(tally.errors), "error_samples": tally.samples,
        **watch.summary(), "open_fds_before_sigterm": fds_before_sigterm, "shutdown": end, "log": str(log),
    }
    accounted = counts["completed"] + counts["refused"] + counts["disconnected"] == counts["sent"]
    summary["every_request_accounted"] = accounted
    ok = (not tally.errors and accounted and summary["rss_bounded"] and end["exit_status"] == 0 and end["bounded"]
          and not end["streams_hung"] and counts["completed"] > 0)
    return report(summary, ok, args.out)


if __name__ == "__main__":
    sys.exit(main())
