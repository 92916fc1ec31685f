#!/usr/bin/env python3
"""Soak ``kvrt serve``: concurrent clients send random valid and invalid requests, and every reply is checked.

    nice -n 10 python tools/soak_daemon.py --duration-s 600 --out /tmp/soak.json

Starts ``kvrt serve --state-dir`` on a generated tiny model with room for three live
contexts (so agents swap), runs ``--clients`` clients for ``--duration-s`` seconds
(REGISTER, DECODE, FORK, UNREGISTER, STATUS, LIST, METRICS, HELP, garbage, over-long and
non-UTF-8 lines, the odd reconnect) and checks that each reply is whole and answers its
own request (a DECODE echoes its agent id, a FORK its source and new id, a LIST has as
many rows as it says, a bad line gets the ERR code for what was wrong), while the
daemon's RSS is sampled from /proc. Then SIGTERM (exit 0, socket removed), a restart on
the same state directory (every agent back, with the tokens it held), and SIGTERM again.
Prints a JSON summary; exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _soak import Watch, report, run_clients

from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.modelfiles.testmodels import write_model
from kvrt.serve.client import Client, ConnectionLost, DaemonReplyError
from kvrt.serve.protocol import HELP_LINES, MAX_LINE, parse_fields

N_CTX_CHOICES = (256, 512)
LIVE_CONTEXTS = 3
CLIENT_TIMEOUT_S = 300.0
WORDS = ("the", "agent", "reads", "a", "long", "document", "über", "naïve", "数据", "and", "then", "writes", "🙂")
GARBAGE = ("FOO bar", "   ", "DECODE", "DECODE x 0 hi", "DECODE x many hi", "REGISTER only", "STATUS now",
           "DECODE x 3 bad \\q escape", "UNREGISTER", "FORK a", "HELP\x00", "REGISTER a b -1")
# ERR codes a request may legitimately get while other clients change the same agents; anything else is a failure
ALLOWED = {
    "register": {"AGENT_EXISTS", "VRAM_LEDGER_DENY"},
    "decode": {"UNKNOWN_AGENT", "CONTEXT_FULL", "VRAM_LEDGER_DENY"},  # CONTEXT_FULL: its history filled n_ctx
    "fork": {"UNKNOWN_AGENT", "AGENT_EXISTS", "VRAM_LEDGER_DENY"},
    "unregister": {"UNKNOWN_AGENT"},
    "status": set(), "list": set(), "metrics": set(), "help": set(),
    "garbage": {"UNKNOWN_VERB", "EMPTY", "BAD_ARGS", "BAD_NUMBER"},
    "overlong": {"LINE_TOO_LONG"},
    "bad_utf8": {"BAD_UTF8"},
}
MUST_FAIL = {"garbage", "overlong", "bad_utf8"}


class Violation(Exception):
    """A reply that is incomplete, malformed, or answers another request."""


@dataclass
class Tally:
    """Counts shared by the client threads (one lock; a sample of each kind of failure kept)."""

    served: Counter[str] = field(default_factory=Counter)
    expected_errors: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, kind: str) -> None:
        with self.lock:
            self.served[kind] += 1

    def expected(self, kind: str, code: str) -> None:
        with self.lock:
            self.served[kind] += 1
            self.expected_errors[f"{kind}:{code}"] += 1

    def violation(self, kind: str, detail: str) -> None:
        with self.lock:
            self.violations[kind] += 1
            self.samples.setdefault(kind, detail[:300])


Check = Callable[[list[str], "str | None"], None]


def merged(lines: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        out.update(parse_fields(line))
    return out


def expect(condition: bool, what: str, lines: list[str]) -> None:
    if not condition:
        raise Violation(f"{what}: {lines[:3]!r}")


def check_decode(agent: str, n_tokens: int) -> Check:
    def check(lines: list[str], text: str | None) -> None:
        fields = merged(lines)
        expect(fields.get("call") == "DECODE" and fields.get("agent_id") == agent, f"DECODE {agent} echo", lines)
        expect(text is not None and int(fields.get("generated_tokens", -1)) <= n_tokens, "DECODE text/count", lines)
    return check


def check_first(prefix: str, **fields: str) -> Check:
    def check(lines: list[str], text: str | None) -> None:
        got = parse_fields(lines[0]) if lines else {}
        expect(bool(lines) and lines[0].startswith(prefix) and all(got.get(k) == v for k, v in fields.items()),
               f"{prefix} {fields}", lines)
    return check


def check_list(lines: list[str], text: str | None) -> None:
    expect(bool(lines) and lines[0].startswith("OK agents="), "LIST header", lines)
    rows = int(parse_fields(lines[0])["agents"])
    expect(len(lines) == rows + 1 and all("agent=" in line for line in lines[1:]), "LIST row count", lines)


def check_help(lines: list[str], text: str | None) -> None:
    expect(len(lines) == len(HELP_LINES) + 1 and lines[0].startswith("OK schema="), "HELP lines", lines)


def random_request(rng: random.Random, names: list[str], model: Path) -> tuple[str, str, Check | None]:
    """(kind, request line, reply check); the check is None for requests that must be refused."""
    pick = rng.random()
    name = rng.choice(names)
    if pick < 0.16:
        return "register", f"REGISTER {name} {model} {rng.choice(N_CTX_CHOICES)}", check_first(
            "OK registered", agent=name)
    if pick < 0.60:
        n = rng.randint(1, 12)
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        if rng.random() < 0.2:
            prompt += "\\nnext line"
        return "decode", f"DECODE {name} {n} {prompt}", check_decode(name, n)
    if pick < 0.65:
        new = rng.choice(names)
        return "fork", f"FORK {name} {new}", check_first("OK forked", agent=new, source=name)
    if pick < 0.70:
        return "unregister", f"UNREGISTER {name}", check_first("OK unregistered", agent=name)
    if pick < 0.76:
        return "status", "STATUS", check_first("OK schema=")
    if pick < 0.82:
        return "list", "LIST", check_list
    if pick < 0.85:
        return "metrics", "METRICS", check_first("OK agent=all")
    if pick < 0.88:
        return "help", "HELP", check_help
    if pick < 0.97:
        return "garbage", rng.choice(GARBAGE), None
    return "overlong", "HELP" + " " * MAX_LINE, None


def send_one(client: Client, kind: str, line: str, check: Check | None, tally: Tally) -> None:
    try:
        lines, text = client.request(line)
    except DaemonReplyError as exc:
        if exc.code in ALLOWED[kind]:
            tally.expected(kind, exc.code)
        else:
            tally.violation(f"{kind}:unexpected_{exc.code}", exc.line)
        return
    if check is None:
        tally.violation(f"{kind}:accepted", repr(lines[:2]))
        return
    try:
        check(lines, text)
    except Violation as exc:
        tally.violation(f"{kind}:mismatch", str(exc))
        return
    tally.ok(kind)


def raw_bad_utf8(path: Path, tally: Tally) -> None:
    """A non-UTF-8 line, which kvrt.Client cannot send, on a connection of its own."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CLIENT_TIMEOUT_S)
        s.connect(str(path))
        s.sendall(b"HELP \xff\xfe\n")
        data = b""
        while not data.endswith(b"\nEND\n") and (chunk := s.recv(4096)):
            data += chunk
    if data.startswith(b"ERR BAD_UTF8 ") and data.endswith(b"\nEND\n"):
        tally.expected("bad_utf8", "BAD_UTF8")
    else:
        tally.violation("bad_utf8:mismatch", repr(data[:200]))


def client_loop(index: int, path: Path, model: Path, until: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed * 1000 + index)
    names = [f"c{index}-{k}" for k in range(3)] + [f"shared-{k}" for k in range(4)]
    client = Client(path, timeout=CLIENT_TIMEOUT_S)
    try:
        while time.monotonic() < until:
            if rng.random() < 0.02:
                raw_bad_utf8(path, tally)
                continue
            kind, line, check = random_request(rng, names, model)
            try:
                send_one(client, kind, line, check, tally)
            except (ConnectionLost, OSError) as exc:
                tally.violation(f"{kind}:connection_lost", f"{type(exc).__name__}: {exc}")
                client.close()
                client = Client(path, timeout=CLIENT_TIMEOUT_S)
            if rng.random() < 0.02:  # clients come and go too
                client.close()
                client = Client(path, timeout=CLIENT_TIMEOUT_S)
    finally:
        client.close()


def start_daemon(sock: Path, model: Path, state: Path, log: Path) -> subprocess.Popen[str]:
    shape = ModelShape.read(model)
    context_bytes = context_estimate(shape, max(N_CTX_CHOICES)).total_bytes
    capacity = shape.weight_bytes(on_gpu=False) + LIVE_CONTEXTS * context_bytes
    with log.open("a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvrt.cli", "serve", "--socket", str(sock), "--threads", "1",
                                 "--capacity-bytes", str(capacity), "--state-dir", str(state)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    banner = proc.stdout.readline() if proc.stdout else ""
    if "listening on" not in banner:
        proc.kill()
        raise SystemExit(f"kvrt serve did not start: {banner!r}; see {log}")
    return proc


def terminate(proc: subprocess.Popen[str], sock: Path) -> dict[str, object]:
    """SIGTERM and how the daemon ended: exit status, seconds, whether the socket file is gone."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status: int | None = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = None
    return {"exit_status": status, "seconds": round(time.monotonic() - t0, 3), "socket_removed": not sock.exists()}


def agents_held(sock: Path) -> dict[str, str]:
    with Client(sock, timeout=CLIENT_TIMEOUT_S) as client:
        return {row["agent"]: row["held_tokens"] for row in client.list()}


def restart_check(sock: Path, model: Path, state: Path, log: Path, before: dict[str, str]) -> dict[str, object]:
    """Restart on the state dir: every agent back, swapped, holding what it held; then SIGTERM again."""
    proc = start_daemon(sock, model, state, log)
    with Client(sock, timeout=CLIENT_TIMEOUT_S) as client:
        rows = client.list()
        status = client.status()
    after = {row["agent"]: row["held_tokens"] for row in rows}
    return {"agents_before": len(before), "agents_after": len(after), "same_tokens_held": after == before,
            "all_swapped": all(row["state"] in ("swapped", "cold") for row in rows),
            "state_skipped": status.get("state_skipped"), "shutdown": terminate(proc, sock)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvrt-soak-"))
    model = write_model(work / "soak-tiny.gguf", "tiny", seed=0)
    sock, state, log = work / "kvrt.sock", work / "state", work / "serve.log"
    proc = start_daemon(sock, model, state, log)
    tally, watch = Tally(), Watch(proc.pid).start()
    print(f"soak: {args.clients} clients for {args.duration_s:g} s against pid {proc.pid} ({work})", flush=True)
    elapsed = run_clients(lambda i, until: client_loop(i, sock, model, until, args.seed, tally), args.clients,
                          args.duration_s)
    watch.stop()
    before = agents_held(sock)
    first = terminate(proc, sock)
    restart = restart_check(sock, model, state, log, before)
    summary = {
        "clients": args.clients, "duration_s": round(elapsed, 1), "requests": sum(tally.served.values()),
        "served_by_kind": dict(tally.served), "expected_errors": dict(tally.expected_errors),
        "violations": dict(tally.violations), "violation_samples": tally.samples,
        **watch.summary(),
        "shutdown": first, "restart": restart, "log": str(log),
    }
    ok = (not tally.violations and summary["rss_bounded"] and first["exit_status"] == 0 and first["socket_removed"]
          and restart["same_tokens_held"] and restart["all_swapped"] and restart["state_skipped"] == "0"
          and restart["shutdown"]["exit_status"] == 0)  # type: ignore[index]
    return report(summary, ok, args.out)


if __name__ == "__main__":
    sys.exit(main())
