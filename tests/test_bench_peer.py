"""``kvrt bench peer``: its workloads (deterministic, vocabulary-safe, later turns extending earlier ones exactly),
its metrics (per-turn TTFT percentiles, lost tokens), how it reads each server's stream, and small end-to-end runs:
the kvrt arm alone on the tiny test model, and both arms where a llama-server binary is found. No timing is
asserted (speed lives in the benchmarks)."""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from kvrt.system.cpu import EXTRA_BUFTS_ENV, safe_extra_bufts  # noqa: E402
from kvrt_bench import peer  # noqa: E402
from kvrt_bench._peer_client import TurnResult, token_agreement, turn_metrics  # noqa: E402
from kvrt_bench._peer_servers import (  # noqa: E402
    LLAMA_SERVER_ENV,
    PeerError,
    ServerArm,
    ServerConfig,
    batched_bench,
    find_llama_server,
)
from kvrt_bench._peer_workloads import Sizes, WorkloadError, build, safe_vocabulary  # noqa: E402

TINY_SIZES = ["--fanout-doc", "40", "--fanout-question", "8", "--swarm-doc", "24", "--swarm-task", "8",
              "--swarm-turns", "3", "--swarm-append", "8", "--private-history", "32", "--private-append", "8",
              "--gen-tokens", "4"]


def _args(*argv: str, out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.out = str(out)
    return args


def test_prompts_are_deterministic_vocabulary_safe_and_shaped_as_their_workload(tiny_model_path, tiny_model):
    vocabulary = safe_vocabulary(tiny_model_path)
    assert vocabulary == sorted(set(vocabulary)) and not {0, 1, 2} & set(vocabulary)  # UNK, BOS, EOS
    assert all(not tiny_model.is_eog(t) and t < tiny_model.n_vocab for t in vocabulary)
    sizes = Sizes(shared=30, own=5, turns=3, append=4, gen=2)
    one, again = (build("swarm", sizes, 3, vocabulary, seed=7) for _ in range(2))
    assert one == again and one != build("swarm", sizes, 3, vocabulary, seed=8)
    assert all(len(p) == 35 and p[:30] == one.first[0][:30] for p in one.first)  # the shared document
    assert len({tuple(p[30:]) for p in one.first}) == 3  # a task of each agent's own
    assert [[len(a) for a in agent] for agent in one.appends] == [[4, 4]] * 3
    private = build("private", Sizes(0, 12, 2, 3, 2), 2, vocabulary, seed=7)
    assert private.first[0][:4] != private.first[1][:4]
    assert sizes.cells_per_agent == 30 + 5 + 3 * 2 + 2 * 4
    with pytest.raises(WorkloadError, match="unknown workload"):
        build("chat", sizes, 1, vocabulary, seed=0)
    with pytest.raises(WorkloadError, match="positive"):
        Sizes(0, 0, 1, 0, 1)


def test_a_later_turn_is_the_previous_prompt_the_completion_and_new_tokens(tiny_model_path):
    workload = build("swarm", Sizes(8, 4, 3, 5, 2), 2, safe_vocabulary(tiny_model_path), seed=1)
    second = workload.next_prompt(1, 1, workload.first[1], [11, 12])
    assert second == workload.first[1] + [11, 12] + workload.appends[1][0]
    third = workload.next_prompt(1, 2, second, [13, 14])
    assert third[:len(second)] == second and third[len(second):] == [13, 14] + workload.appends[1][1]
    with pytest.raises(WorkloadError, match="no new tokens"):
        workload.next_prompt(1, 3, third, [])


def _turn(agent: int, turn: int, ttft_ms: float, tokens: int, expected: int = 4, error: str | None = None):
    return TurnResult(agent, turn, 10, expected, sent_s=1.0, first_s=1.0 + ttft_ms / 1e3, end_s=2.0,
                      tokens=list(range(tokens)), error=error, received=tokens)


def test_metrics_give_percentiles_per_turn_and_count_lost_tokens():
    results = [_turn(a, 0, 100.0 * (a + 1), 4) for a in range(4)] + [_turn(a, 1, 10.0, 4) for a in range(3)]
    results.append(_turn(3, 1, 20.0, 1))  # came back short: 3 tokens lost
    m = turn_metrics(results, n_agents=4, turns=2, gen=4, wall_s=2.0)
    assert m["ttft_p50_ms_turn1"] == pytest.approx(250.0) and m["ttft_p99_ms_turn1"] == pytest.approx(397.0)
    assert m["ttft_p50_ms_turn2"] == pytest.approx(10.0)
    assert m["lost_tokens"] == 3 and m["incomplete_requests"] == 1 and m["output_tokens"] == 29
    assert m["output_tokens_per_s"] == pytest.approx(14.5)
    # an agent that stopped after a failed turn never sent its next one: those tokens are lost too
    stopped = turn_metrics(results[:4] + results[4:7], n_agents=4, turns=2, gen=4, wall_s=2.0)
    assert stopped["lost_tokens"] == 4 and stopped["requests"] == 7 and stopped["requests_expected"] == 8
    assert not _turn(0, 0, 1.0, 4, error="HTTP 500").complete and _turn(0, 0, 1.0, 4).complete


def test_token_agreement_counts_up_to_each_requests_first_difference():
    a = [TurnResult(0, 0, 1, 4, 0.0, tokens=[1, 2, 3, 4]), TurnResult(1, 0, 1, 4, 0.0, tokens=[5, 6, 7, 8])]
    b = [TurnResult(0, 0, 1, 4, 0.0, tokens=[1, 2, 9, 4]), TurnResult(1, 0, 1, 4, 0.0, tokens=[5, 6, 7, 8])]
    assert token_agreement(a, b) == pytest.approx(6 / 8) and token_agreement(a, a) == 1.0


def test_each_arms_stream_chunks_give_their_token_ids_and_usage():
    kvrt = ServerArm("kvrt", [], {}, "/v1/models", 1, "m")
    server = ServerArm("llama-server", [], {}, "/health", 1, "m")
    assert kvrt.chunk_tokens({"choices": [{"text": "a", "tokens": [7]}]}) == [7]
    assert kvrt.chunk_usage({"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens_details":
                                                      {"cached_tokens": 9}}}) == (4, 9)
    assert server.chunk_tokens({"choices": [{"text": "a"}], "__verbose": {"tokens": [7], "stop": False}}) == [7]
    assert server.chunk_usage({"__verbose": {"tokens": [], "stop": True, "tokens_predicted": 4}}) == (4, None)
    assert server.body([1, 2], 4)["verbose"] and "verbose" not in kvrt.body([1, 2], 4)
    assert all(arm.body([1], 4)["ignore_eos"] and arm.body([1], 4)["temperature"] == 0 for arm in (kvrt, server))


def test_a_missing_or_unusable_llama_server_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PeerError, match="no llama-server: pass --llama-server"):
        find_llama_server(None)
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    with pytest.raises(PeerError, match="not an executable"):
        find_llama_server(str(not_executable))


def test_the_roomy_arm_runs_exactly_what_llama_server_cannot_hold(tiny_model_path):
    config = ServerConfig(tiny_model_path, 1024, 4, 512, 256, "off", 1)  # 256 cells a llama-server slot
    fits, short = Sizes(0, 200, 1, 0, 16), Sizes(300, 32, 1, 0, 16)  # 216 and 348 cells an agent
    assert peer._skip_reason("llama-server", config, fits) is None and peer._skip_reason(peer.ROOMY, config, fits)
    assert "needs 348" in peer._skip_reason("llama-server", config, short)
    assert peer._skip_reason(peer.ROOMY, config, short) is None
    assert peer._skip_reason("kvrt", config, short) is None  # kvrt's slots share the cells as they need them
    assert peer.auto_cells(4, {"fits": fits, "short": short}) // 4 >= short.cells_per_agent  # roomy's cells


def test_the_roomy_arm_runs_without_llama_servers_host_prompt_cache_unless_told(tiny_model_path, tmp_path):
    config = ServerConfig(tiny_model_path, 1024, 4, 512, 256, "off", 1)
    binary = tmp_path / "llama-server"

    def argv(name: str, server_args: str) -> list[str]:
        args = _args("--model", str(tiny_model_path), "--server-args", server_args, out=tmp_path)
        return peer._make_arm(name, config, args, binary, tmp_path).argv

    assert argv(peer.ROOMY, "")[-2:] == ["--cache-ram", "0"]
    assert "--cache-ram" not in argv("llama-server", "")  # the plain arm keeps llama-server's default
    # llama.cpp reads its options in order: the user's own value comes after the arm's, so it wins
    assert argv(peer.ROOMY, "--cache-ram 512 -t 2")[-6:] == ["--cache-ram", "0", "--cache-ram", "512", "-t", "2"]


def test_every_arm_loads_the_weights_as_kvrts_verdict_for_this_cpu_says(tiny_model_path, tmp_path):
    args = _args("--model", str(tiny_model_path), out=tmp_path)
    for extra_bufts, flag, env in ((True, "--repack", "on"), (False, "--no-repack", "off")):
        config = ServerConfig(tiny_model_path, 64, 4, 512, 256, "off", 1, extra_bufts)
        assert flag in peer._make_arm("llama-server", config, args, tmp_path / "llama-server", tmp_path).argv
        assert peer._make_arm("kvrt", config, args, None, tmp_path).env[EXTRA_BUFTS_ENV] == env
        ideal = batched_bench(tmp_path / "llama-batched-bench", tmp_path, config, 32, 4, False, 1.0)
        assert "skipped" in ideal and flag in ideal["argv"].split()  # 4 x 36 cells do not fit 64: never started


def _stand_in_batched_bench(path: Path, unified_s: float, split_s: float) -> Path:
    """An executable that answers as llama-batched-bench's jsonl does, with ``unified_s`` seconds under ``-kvu``
    and ``split_s`` without ($t spliced in outside the quotes): what the layout choice reads, not llama.cpp's timing."""
    answer = json.dumps({"t_pp": 0.5, "t_tg": 0.5, "t": "T", "speed_tg": 1, "speed": 1}).replace('"T"', "'$t'")
    path.write_text(f"#!/bin/sh\nt={split_s}\nfor a in \"$@\"; do [ \"$a\" = -kvu ] && t={unified_s}; done\n"
                    f"echo '{answer}'\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(("unified_s", "split_s", "chosen"), [(1.0, 2.0, "unified"), (3.0, 2.0, "split")])
def test_a_shared_prompts_ideal_is_the_faster_of_llama_cpps_two_kv_layouts(tiny_model_path, tmp_path, unified_s,
                                                                        split_s, chosen):
    binary = _stand_in_batched_bench(tmp_path / "llama-batched-bench", unified_s, split_s)
    config = ServerConfig(tiny_model_path, 1024, 4, 512, 256, "off", 1)
    ideal = batched_bench(binary, tmp_path, config, 32, 4, True, 10.0)
    assert ideal["layout"] == chosen and ideal["t_s"] == min(unified_s, split_s)
    assert {name: point["t_s"] for name, point in ideal["layouts"].items()} == {"unified": unified_s,
                                                                                "split": split_s}
    assert "-kvu" in ideal["layouts"]["unified"]["argv"].split()
    assert "-kvu" not in ideal["layouts"]["split"]["argv"].split()
    private = batched_bench(binary, tmp_path, config, 32, 4, False, 10.0)
    assert private["t_s"] == split_s and "layout" not in private  # own prompts: one stream a sequence only


def test_a_shared_prompt_that_only_the_unified_layout_holds_gets_that_layouts_ideal(tiny_model_path, tmp_path):
    binary = _stand_in_batched_bench(tmp_path / "llama-batched-bench", 1.0, 0.5)
    config = ServerConfig(tiny_model_path, 64, 4, 512, 256, "off", 1)  # 4 x (32 + 4) do not fit, 32 + 4 x 4 do
    ideal = batched_bench(binary, tmp_path, config, 32, 4, True, 10.0)
    assert ideal["layout"] == "unified" and ideal["t_s"] == 1.0
    assert "needs 144 cells" in ideal["layouts"]["split"]["skipped"]


def test_the_kvrt_arm_alone_serves_every_turn_in_full(tiny_model_path, tmp_path):
    args = _args("--model", str(tiny_model_path), "--arms", "kvrt", "--agents", "2", "--threads", "1",
                 "--flash-attn", "off", *TINY_SIZES, out=tmp_path)
    assert peer.run(args) == 0
    result = json.loads((tmp_path / "peer" / "peer.json").read_text())
    rows = {r["workload"]: r for r in result["rounds"]}
    assert set(rows) == {"fanout", "swarm", "private"}
    for name, turns in (("fanout", 1), ("swarm", 3), ("private", 2)):
        assert rows[name]["lost_tokens"] == 0 and rows[name]["incomplete_requests"] == 0
        assert rows[name]["output_tokens"] == 2 * turns * 4 and rows[name]["requests"] == 2 * turns
    assert rows["fanout"]["kvrt_reused_tokens"] >= 40 - 1  # the second agent reads the shared document's cells
    assert rows["swarm"]["kvrt_reused_tokens"] > rows["fanout"]["kvrt_reused_tokens"]  # later turns too
    with (tmp_path / "peer" / "requests.csv").open() as fh:
        swarm = [r for r in csv.DictReader(fh) if r["workload"] == "swarm" and r["agent"] == "0"]
    # each later prompt: the previous one + 4 output tokens + 8 new ones
    assert [int(r["prompt_tokens"]) for r in swarm] == [32, 44, 56]
    sent, end = [float(r["sent_ms"]) for r in swarm], [float(r["end_ms"]) for r in swarm]
    assert min(sent) >= 0 and all(s >= e for s, e in zip(sent[1:], end[:-1]))  # each turn sent after the last ended
    assert result["libraries"]["kvrt"] and (tmp_path / "peer" / "peer.csv").exists()
    assert result["extra_bufts"]["use"] == safe_extra_bufts().use_extra_bufts


@pytest.fixture()
def llama_server() -> Path:
    """The llama-server binary ``kvrt bench peer`` would find, or the test is skipped."""
    try:
        return find_llama_server(None)
    except PeerError as exc:
        pytest.skip(f"no llama-server binary ({exc})")


def _tiny_peer(tiny_model_path: Path, out: Path, *options: str) -> argparse.Namespace:
    return _args("--model", str(tiny_model_path), "--agents", "2", "--threads", "1", "--flash-attn", "off",
                 *options, *TINY_SIZES, out=out)


def test_both_arms_on_the_tiny_model_when_llama_server_is_found(tiny_model_path, tmp_path, llama_server):
    args = _tiny_peer(tiny_model_path, tmp_path)
    assert peer.run(args) == 0
    result = json.loads((tmp_path / "peer" / "peer.json").read_text())
    assert {r["arm"] for r in result["rounds"]} == {"kvrt", "llama-server"}
    assert all(r["lost_tokens"] == 0 for r in result["rounds"])
    # both arms mapped the one libllama (llama-server through LD_LIBRARY_PATH)
    digests = {arm: set(files.values()) for arm, files in result["libraries"].items()}
    assert len(digests["kvrt"]) == 1 and digests["kvrt"] == digests["llama-server"]
    assert "kvrt_over_llama_server_wall" in result["summary"]["N=2 swarm"]
    assert os.path.exists(tmp_path / "peer" / "peer.png")
    ideal = result["ideal"]["2"]  # batched-bench beside llama-server, both layouts for a shared prompt
    for shared in ("fanout", "swarm"):
        seconds = {name: point["t_s"] for name, point in ideal[shared]["layouts"].items()}
        assert set(seconds) == {"split", "unified"} and ideal[shared]["t_s"] == min(seconds.values())
    assert "t_s" in ideal["private"] and "layouts" not in ideal["private"]


def test_llama_server_given_the_cells_it_needs_where_the_shared_count_is_short(tiny_model_path, tmp_path,
                                                                              llama_server):
    args = _tiny_peer(tiny_model_path, tmp_path, "--cells", "100", "--roomy")  # 50 a slot: private (48) fits
    assert peer.run(args) == 0
    rows = json.loads((tmp_path / "peer" / "peer.json").read_text())["rounds"]
    ran = {(r["arm"], r["workload"]) for r in rows if "skipped" not in r}
    assert ran == {("kvrt", "fanout"), ("kvrt", "swarm"), ("kvrt", "private"), ("llama-server", "private"),
                   (peer.ROOMY, "fanout"), (peer.ROOMY, "swarm")}
    assert all(r["lost_tokens"] == 0 for r in rows if "skipped" not in r)
