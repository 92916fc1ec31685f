"""``kvrt bench elastic --part c``: one two-turn agent in an ElasticContext and in a fixed context of its maximum.

Greedy tokens must be equal; reported are time per generated token, the growth's time
on the critical path against the prefill it accompanies, and the work done off the path
(spares, moves ahead), per elastic arm (:data:`ELASTIC_ARMS`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ELASTIC_ARMS = {
    # name: (expected_tokens at registration, prepare() a spare between turns, use --grow-ahead between turns)
    "spare": (True, True, True),
    "spare-no-ahead": (True, True, False),
    "cold": (False, False, True),
}


def _final_bucket(n_tokens: int, min_ctx: int = 256) -> int:
    size = min_ctx
    while size < n_tokens:
        size *= 2
    return size


def part_c(args: argparse.Namespace) -> dict[str, Any]:
    from kvrt.engine.context import Context
    from kvrt.engine.generation import GenerationParams, generate
    from kvrt.engine.model import Model
    from kvrt.memory.elastic_context import ElasticContext

    path = args.model
    if not path:
        from kvrt.modelfiles.testmodels import write_model

        path = str(write_model(Path(tempfile.mkdtemp()) / "tiny.gguf", "tiny", seed=args.seed))
    model = Model(path, n_gpu_layers=args.n_gpu_layers)
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(3, min(model.n_vocab, 32000), args.prompt_tokens)]
    prompt[0] = 1  # BOS
    params = GenerationParams(max_tokens=args.gen_tokens)
    split = max(1, args.prompt_tokens // 4)
    turns = [prompt[:split], prompt[split:]]  # turn 2's growth carries turn 1's state
    # the agent's maximum and the fixed arm's size: the bucket holding both turns and their generations
    final_ctx = _final_bucket(args.prompt_tokens + 2 * args.gen_tokens)
    first_need = len(turns[0]) + args.gen_tokens  # what registration is told the first request needs
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ELASTIC_ARMS]
    if unknown or not arms:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {sorted(ELASTIC_ARMS)}")
    runs: dict[str, list[dict[str, float]]] = {"fixed": [], **{a: [] for a in arms}}
    tokens: dict[str, list[list[int]]] = {}
    moves_seen: dict[str, list[dict[str, Any]]] = {}
    spares_seen: dict[str, list[dict[str, Any]]] = {}

    def two_turns(arm: str, complete: Any, between: Any = None) -> None:
        """Both turns; every request's wait is inside its ``complete`` (growth included); ``between`` is timed apart."""
        prefill_ms = decode_ms = request_ms = between_ms = 0.0
        generated: list[list[int]] = []
        t0 = time.perf_counter()
        for i, turn in enumerate(turns):
            if i and between is not None:
                tb = time.perf_counter()
                between()  # the agent's idle time between turns: off the critical path
                between_ms += (time.perf_counter() - tb) * 1e3
            tr = time.perf_counter()
            done = complete(turn)
            request_ms += (time.perf_counter() - tr) * 1e3
            prefill_ms += done.timings_ms["prefill_ms"]
            decode_ms += done.timings_ms["decode_ms"]
            generated.append(done.tokens)
        tokens.setdefault(arm, generated)
        if generated != tokens[arm]:
            tokens[arm] = []  # repeats disagree: never counts as equal
        n = max(sum(len(g) for g in generated), 1)
        runs[arm].append({"prefill_ms": prefill_ms, "ms_per_token": decode_ms / n, "request_ms": request_ms,
                          "between_ms": between_ms, "total_ms": (time.perf_counter() - t0) * 1e3})

    for _ in range(args.repeats):
        for arm in arms:
            expect, spare, ahead = ELASTIC_ARMS[arm]
            t_reg = time.perf_counter()
            agent = ElasticContext(model, max_ctx=final_ctx, min_ctx=256,
                                   expected_tokens=first_need if expect else None)
            registration_ms = (time.perf_counter() - t_reg) * 1e3
            registration_spare_ms = sum(sp.create_s for sp in agent.spares) * 1e3
            with agent:
                def between(agent: ElasticContext = agent, spare: bool = spare, ahead: bool = ahead) -> None:
                    if ahead and args.grow_ahead > 0:
                        agent.grow_ahead(args.grow_ahead)
                    if spare:
                        agent.prepare()  # keep one spare of the next bucket (none at max_ctx)

                two_turns(arm, lambda turn, agent=agent: agent.generate(turn, params), between)
                # what is still held after the last turn stays held until the agent closes (not timed: not growth)
                held_after = [(sp.nbytes, agent.spare_held_s()) for sp in agent.spares if sp.outcome == "held"]
                final = agent.n_ctx
            on = [r for r in agent.resizes if r.on_path]
            off = [r for r in agent.resizes if not r.on_path]
            spare_create_ms = sum(sp.create_s for sp in agent.spares) * 1e3
            runs[arm][-1].update(
                growth_ms=sum(r.seconds for r in on) * 1e3, moves=len(on),
                on_path_create_ms=sum(r.create_s for r in on) * 1e3,
                on_path_empty_ms=sum(r.seconds for r in on if not r.n_tokens) * 1e3,
                on_path_spare_moves=sum(r.spare for r in on),
                off_path_move_ms=sum(r.seconds for r in off) * 1e3, off_path_moves=len(off),
                spare_create_ms=spare_create_ms, off_path_ms=sum(r.seconds for r in off) * 1e3 + spare_create_ms,
                registration_ms=registration_ms, registration_spare_ms=registration_spare_ms,
                spares=len(agent.spares), spares_used=sum(sp.outcome == "used" for sp in agent.spares),
                spare_peak_mb=max((sp.nbytes for sp in agent.spares), default=0) / 1e6,
                spare_held_ms=sum(sp.held_s for sp in agent.spares) * 1e3,
                spare_mb_s=sum(sp.nbytes * sp.held_s for sp in agent.spares) / 1e6,
                spare_held_after_mb=sum(b for b, _ in held_after) / 1e6,
                moved_state_mb=sum(r.state_bytes for r in agent.resizes) / 1e6, final_ctx=final)
            moves_seen[arm] = [{"from": r.from_ctx, "to": r.to_ctx, "tokens": r.n_tokens,
                                "state_mb": r.state_bytes / 1e6, "ms": r.seconds * 1e3, "on_path": r.on_path,
                                "spare": r.spare, "capture_ms": r.capture_s * 1e3, "create_ms": r.create_s * 1e3,
                                "restore_ms": r.restore_s * 1e3, "close_ms": r.close_s * 1e3} for r in agent.resizes]
            spares_seen[arm] = [{"n_ctx": sp.n_ctx, "mb": sp.nbytes / 1e6, "create_ms": sp.create_s * 1e3,
                                 "held_ms": sp.held_s * 1e3, "outcome": sp.outcome} for sp in agent.spares]
        t_reg = time.perf_counter()
        ctx = Context(model, n_ctx=final_ctx)
        registration_ms = (time.perf_counter() - t_reg) * 1e3
        with ctx:
            two_turns("fixed", lambda turn, ctx=ctx: generate(ctx, turn, params))
            runs["fixed"][-1].update(registration_ms=registration_ms)
    model.close()
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    best = {arm: {k: min(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}  # least disturbed run
    f = med["fixed"]
    per_arm = {}
    for arm in arms:
        e = med[arm]
        per_arm[arm] = {
            "tokens_equal": bool(tokens[arm]) and tokens[arm] == tokens["fixed"],
            "tpot_ratio_elastic_over_fixed": e["ms_per_token"] / f["ms_per_token"],
            "growth_over_prefill": e["growth_ms"] / f["prefill_ms"],
            "off_path_over_prefill": e["off_path_ms"] / f["prefill_ms"],
            "best_tpot_ratio": best[arm]["ms_per_token"] / best["fixed"]["ms_per_token"],
            "best_growth_over_prefill": best[arm]["growth_ms"] / best["fixed"]["prefill_ms"],
            "last_run_moves": moves_seen[arm], "last_run_spares": spares_seen[arm],
        }
    head = arms[0]
    result = {
        "model": Path(path).name, "turn_prompt_tokens": [len(t) for t in turns],
        "gen_tokens": [len(g) for g in tokens["fixed"]], "final_ctx": final_ctx, "expected_tokens": first_need,
        "arms": arms, "headline_arm": head,
        "tokens_equal": all(per_arm[a]["tokens_equal"] for a in arms), "median": med, "runs": runs, "best": best,
        "per_arm": per_arm, "grow_ahead_fill": args.grow_ahead,
        # the headline arm's figures under the keys earlier runs used
        **{k: per_arm[head][k] for k in ("tpot_ratio_elastic_over_fixed", "growth_over_prefill",
                                           "off_path_over_prefill", "best_tpot_ratio", "best_growth_over_prefill")},
    }
    print(f"  agent max_ctx = fixed n_ctx = {final_ctx}; turns {result['turn_prompt_tokens']} prompt tokens, "
          f"{args.gen_tokens} generated each; registration told {first_need} tokens where an arm uses expected_tokens")
    equal = ", ".join(f"{a} {per_arm[a]['tokens_equal']}" for a in arms)
    print(f"  tokens equal: {result['tokens_equal']} ({equal}); fixed: prefill {f['prefill_ms']:.1f} ms (both "
          f"turns), {f['ms_per_token']:.3f} ms/token, its {final_ctx}-cell context created at registration in "
          f"{f['registration_ms']:.1f} ms")
    for arm in arms:
        e, r = med[arm], per_arm[arm]
        expect, spare, ahead = ELASTIC_ARMS[arm]
        how = (f"expected_tokens={'yes' if expect else 'no'}, between turns: "
               + (" + ".join(x for x in ((f"grow_ahead({args.grow_ahead:g})" if ahead and args.grow_ahead > 0 else ""),
                                         ("prepare()" if spare else "")) if x) or "nothing"))
        print(f"  [{arm}] ({how})")
        print(f"    ms/token {e['ms_per_token']:.3f} (ratio to fixed {r['tpot_ratio_elastic_over_fixed']:.3f}); "
              f"elastic prefill incl. growth {e['prefill_ms']:.1f} ms; requests waited {e['request_ms']:.1f} ms in all "
              f"(fixed {f['request_ms']:.1f})")
        print(f"    ON the critical path: {e['moves']:.0f} moves ({e['on_path_spare_moves']:.0f} into a prepared "
              f"spare), {e['growth_ms']:.2f} ms = {r['growth_over_prefill']:.1%} of the fixed prefill (target < 5%); "
              f"of it context creation {e['on_path_create_ms']:.2f} ms")
        print(f"    OFF the path: {e['off_path_ms']:.2f} ms = {r['off_path_over_prefill']:.1%} of the fixed prefill "
              f"(spare creation {e['spare_create_ms']:.2f} ms, of it {e['registration_spare_ms']:.2f} ms at "
              f"registration; moves ahead {e['off_path_moves']:.0f}, {e['off_path_move_ms']:.2f} ms); registration "
              f"in all {e['registration_ms']:.1f} ms, between turns {e['between_ms']:.1f} ms")
        print(f"    spares: {e['spares']:.0f} made, {e['spares_used']:.0f} used; largest {e['spare_peak_mb']:.1f} MB "
              f"(ledger charge), held {e['spare_held_ms']:.1f} ms in all = {e['spare_mb_s']:.3f} MB*s; still held "
              f"after the last turn: {e['spare_held_after_mb']:.1f} MB")
        for mv in r["last_run_moves"]:
            print(f"      move {mv['from']:>6} -> {mv['to']:>6} cells carrying {mv['tokens']:>6} tokens "
                  f"({mv['state_mb']:.1f} MB): {mv['ms']:.2f} ms {'on the path' if mv['on_path'] else 'ahead'}"
                  f"{' into a spare' if mv['spare'] else ''} (state out {mv['capture_ms']:.2f}, create context "
                  f"{mv['create_ms']:.2f}, state in {mv['restore_ms']:.2f}, close old {mv['close_ms']:.2f} ms)")
        for sp in r["last_run_spares"]:
            print(f"      spare {sp['n_ctx']:>6} cells, {sp['mb']:.1f} MB: created in {sp['create_ms']:.2f} ms, "
                  f"held {sp['held_ms']:.1f} ms, {sp['outcome']}")
        print(f"    best of {args.repeats}: ms/token ratio {r['best_tpot_ratio']:.3f}, growth/prefill "
              f"{r['best_growth_over_prefill']:.1%}")
    return result

