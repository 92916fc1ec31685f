"""The extra-buffer-type decision: a probe child that crashes, hangs or lies never costs the caller."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrt.system import cpu
from kvrt.system.cpu import CpuInfo, ProbeOutcome, decide_extra_bufts, run_probe
from kvrt.system.gpu import llama_gpu_devices

WITH_REPACK = CpuInfo("test CPU", frozenset({"avx2", "amx_tile"}), {"AMX_INT8": "1"}, ("AMX", "CPU_REPACK"))
WITHOUT_EXTRA = CpuInfo("test CPU", frozenset({"avx2"}), {}, ())


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _never() -> ProbeOutcome:
    raise AssertionError("the probe must not run here")


def test_advertised_flags_parses_x86_and_arm_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Xeon Platinum\nflags\t\t: fpu avx2 amx_tile avx512f\n\n"
                   "processor\t: 1\nmodel name\t: Xeon Platinum\nflags\t\t: fpu\n")
    name, flags = cpu.advertised_flags(x86)
    assert name == "Xeon Platinum"
    assert flags == {"fpu", "avx2", "amx_tile", "avx512f"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert cpu.advertised_flags(arm)[1] == {"fp", "asimd", "sve"}
    assert cpu.advertised_flags(tmp_path / "missing")[1] == frozenset()


def test_notable_flags_are_the_kernel_deciding_ones() -> None:
    info = CpuInfo("x", frozenset({"fpu", "amx_tile", "avx512_vnni", "sse2"}), {}, ())
    assert info.notable_flags == ["amx_tile", "avx512_vnni"]


def test_probe_child_killed_by_sigsegv_is_a_failed_probe_not_a_crash() -> None:
    outcome = run_probe(_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    assert not outcome.ok
    assert "SIGSEGV" in outcome.detail


def test_probe_child_that_hangs_is_stopped_at_the_timeout() -> None:
    outcome = run_probe(_python("import time; time.sleep(60)"), timeout_s=1.0)
    assert not outcome.ok
    assert "did not finish within 1 s" in outcome.detail


def test_probe_child_that_fails_reports_its_last_error_line() -> None:
    outcome = run_probe(_python("import sys; sys.stderr.write('boom: no AMX tiles\\n'); sys.exit(3)"))
    assert not outcome.ok
    assert "exit 3" in outcome.detail and "boom: no AMX tiles" in outcome.detail


def test_probe_child_without_a_verdict_is_a_failed_probe() -> None:
    outcome = run_probe(_python("print('hello')"))
    assert not outcome.ok
    assert "no verdict" in outcome.detail


def test_probe_child_verdict_is_read() -> None:
    outcome = run_probe(_python("import json; print(json.dumps({'ok': True, 'detail': 'fine'}))"))
    assert outcome == ProbeOutcome(True, "fine", outcome.elapsed_ms)


def test_probe_child_runs_with_extra_bufts_forced_on() -> None:
    """The child never probes itself (no recursion): it sees KVRT_EXTRA_BUFTS=on."""
    code = f"import json, os; print(json.dumps({{'ok': os.environ['{cpu.EXTRA_BUFTS_ENV}'] == 'on', 'detail': ''}}))"
    assert run_probe(_python(code)).ok


@pytest.mark.parametrize(("value", "expected"), [("on", True), ("off", False), ("OFF", False)])
def test_environment_forces_the_verdict(tmp_path: Path, value: str, expected: bool) -> None:
    verdict = decide_extra_bufts(WITH_REPACK, key="k", env={cpu.EXTRA_BUFTS_ENV: value}, directory=tmp_path,
                                 probe=_never)
    assert (verdict.use_extra_bufts, verdict.source) == (expected, "env")


def test_a_build_without_extra_buffer_types_needs_no_probe(tmp_path: Path) -> None:
    verdict = decide_extra_bufts(WITHOUT_EXTRA, key="k", env={}, directory=tmp_path, probe=_never)
    assert (verdict.use_extra_bufts, verdict.source) == (True, "none")
    assert list(tmp_path.iterdir()) == []


def test_a_crashing_probe_turns_extra_bufts_off_and_is_remembered(tmp_path: Path) -> None:
    crash = _python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    verdict = decide_extra_bufts(WITH_REPACK, key="k1", env={}, directory=tmp_path, probe=lambda: run_probe(crash))
    assert (verdict.use_extra_bufts, verdict.source) == (False, "probe")
    assert "AMX, CPU_REPACK disabled" in verdict.reason and "SIGSEGV" in verdict.reason
    again = decide_extra_bufts(WITH_REPACK, key="k1", env={}, directory=tmp_path, probe=_never)
    assert (again.use_extra_bufts, again.source, again.reason) == (False, "cache", verdict.reason)


def test_a_passing_probe_runs_once_per_key(tmp_path: Path) -> None:
    calls: list[int] = []

    def probe() -> ProbeOutcome:
        calls.append(1)
        return ProbeOutcome(True, "matched", 12.0)

    first = decide_extra_bufts(WITH_REPACK, key="k", env={}, directory=tmp_path, probe=probe)
    second = decide_extra_bufts(WITH_REPACK, key="k", env={}, directory=tmp_path, probe=probe)
    other = decide_extra_bufts(WITH_REPACK, key="other", env={}, directory=tmp_path, probe=probe)
    assert (first.source, second.source, other.source) == ("probe", "cache", "probe")
    assert first.use_extra_bufts and second.use_extra_bufts
    assert len(calls) == 2


def test_a_corrupt_cache_file_is_probed_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "extra-bufts-k.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="kvrt.system.cpu"):
        verdict = decide_extra_bufts(WITH_REPACK, key="k", env={}, directory=tmp_path,
                                     probe=lambda: ProbeOutcome(False, "mismatch", 1.0))
    assert (verdict.use_extra_bufts, verdict.source) == (False, "probe")
    assert "unreadable probe cache" in caplog.text
    assert json.loads((tmp_path / "extra-bufts-k.json").read_text())["use_extra_bufts"] is False


def test_an_unwritable_cache_still_gives_a_verdict(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    verdict = decide_extra_bufts(WITH_REPACK, key="k", env={}, directory=blocker / "sub",
                                 probe=lambda: ProbeOutcome(True, "matched", 1.0))
    assert (verdict.use_extra_bufts, verdict.source) == (True, "probe")


def test_probe_key_follows_the_cpu_and_the_library_build(tmp_path: Path) -> None:
    lib = tmp_path / "libggml-cpu.so"
    lib.write_bytes(b"a")
    key = cpu.probe_key(WITH_REPACK, [lib])
    assert key == cpu.probe_key(WITH_REPACK, [lib])
    assert key != cpu.probe_key(WITHOUT_EXTRA, [lib])
    lib.write_bytes(b"ab")
    assert key != cpu.probe_key(WITH_REPACK, [lib])


def test_cache_dir_follows_the_environment(tmp_path: Path) -> None:
    assert cpu.cache_dir({cpu.CACHE_DIR_ENV: str(tmp_path)}) == tmp_path
    assert cpu.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "kvrt"


def test_this_machine_reports_its_extra_buffer_types_and_features() -> None:
    info = cpu.cpu_info()
    assert all(isinstance(name, str) and name for name in info.extra_buffer_types)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in info.backend_features.items())


def test_the_real_probe_child_decodes_and_compares_on_this_machine() -> None:
    """The default probe loads a Q4_0 model through llama.cpp both ways and gives a verdict with its evidence.

    On a CPU that honours its flags the verdict is ok with the measured difference; on one that does not (the
    AMX VMs this exists for) the child dies or disagrees and the verdict says why: the suite must pass there too.
    """
    outcome = run_probe()
    if outcome.ok:
        assert "max logit difference" in outcome.detail
    else:
        assert "killed by" in outcome.detail or "max logit difference" in outcome.detail or "failed" in outcome.detail


def test_use_extra_bufts_reaches_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp's load log names the extra buffer type only when the flag is on (a fresh process, so no
    ``llama_cpp.Llama`` elsewhere in the test session has taken over llama.cpp's log callback)."""
    from kvrt.modelfiles.cpu_probe import PROBE_PRESET
    from kvrt.modelfiles.testmodels import write_model

    names = cpu.cpu_info().extra_buffer_types
    if not names:
        pytest.skip("this llama.cpp build has no CPU extra buffer types")
    verdict = cpu.safe_extra_bufts()
    if not verdict.use_extra_bufts:
        pytest.skip(f"extra buffer types are unsafe on this machine ({verdict.reason})")
    if llama_gpu_devices():
        pytest.skip("llama.cpp has a GPU here: its host buffer type comes before the CPU's extra buffer types in the "
                    "list for weights kept on the CPU (llama-model.cpp make_cpu_buft_list), so they are never picked")
    path = write_model(tmp_path / "q4.gguf", PROBE_PRESET)
    code = ("import logging, sys; from kvrt.engine.model import Model; lines = []\n"
            "class Keep(logging.Handler):\n    def emit(self, record): lines.append(record.getMessage())\n"
            "log = logging.getLogger('kvrt.llama'); log.addHandler(Keep()); log.setLevel(logging.INFO)\n"
            f"Model({str(path)!r}, n_gpu_layers=0, use_extra_bufts=sys.argv[1] == 'on').close()\n"
            f"print(any(name in line for line in lines for name in {names!r}))")
    seen = {flag: subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, timeout=120,
                                 check=True).stdout.strip() for flag in ("on", "off")}
    assert seen == {"on": "True", "off": "False"}


def test_model_default_takes_the_cached_verdict_in_a_fresh_process(tmp_path: Path, tiny_model_path: Path) -> None:
    """End to end: a stored 'off' verdict (as a crashed probe leaves) makes Model() load without extra bufts."""
    info = cpu.cpu_info()
    if not info.extra_buffer_types:
        pytest.skip("this llama.cpp build has no CPU extra buffer types")
    key = cpu.probe_key(info, cpu._library_files())
    (tmp_path / f"extra-bufts-{key}.json").write_text(json.dumps({"use_extra_bufts": False, "reason": "planted"}))
    code = ("import kvrt.system.cpu, kvrt.engine.model as m; "
            f"model = m.Model({str(tiny_model_path)!r}); v = kvrt.system.cpu.safe_extra_bufts(); "
            "print(model.params.use_extra_bufts, v.source, v.reason)")
    env = {k: v for k, v in os.environ.items() if k != cpu.EXTRA_BUFTS_ENV} | {cpu.CACHE_DIR_ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    assert done.stdout.split() == ["False", "cache", "planted"]


def test_doctor_warns_about_a_gpu_that_kvrt_would_not_use() -> None:
    from kvrt.commands.doctor import warnings_for

    assert warnings_for(nvml_gpus=0, llama_gpu_offload=False, cupy_usable=False) == []
    assert warnings_for(nvml_gpus=1, llama_gpu_offload=True, cupy_usable=True) == []
    cpu_only = warnings_for(nvml_gpus=1, llama_gpu_offload=False, cupy_usable=True)
    assert len(cpu_only) == 1 and "CPU-only build" in cpu_only[0]
    no_cupy = warnings_for(nvml_gpus=2, llama_gpu_offload=True, cupy_usable=False)
    assert len(no_cupy) == 1 and "pageable" in no_cupy[0]


def test_doctor_reports_the_cpu_decision() -> None:
    done = subprocess.run([sys.executable, "-m", "kvrt.cli", "doctor"], capture_output=True, text=True, timeout=120,
                          check=True)
    assert "[CPU]" in done.stdout
    assert "use_extra_bufts=" in done.stdout
    assert "[warnings]" in done.stdout


def test_a_pageable_pool_on_a_gpu_machine_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from kvrt.state import hostpool

    monkeypatch.setattr(hostpool, "cupy_usable", lambda: False)
    monkeypatch.setattr(hostpool, "nvidia_gpu_count", lambda: 1)
    monkeypatch.setattr(hostpool, "_pageable_warned", hostpool.threading.Event())
    with pytest.warns(RuntimeWarning, match="pageable"):
        hostpool.HostPool()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hostpool.HostPool()  # once per process, not per pool
    monkeypatch.setattr(hostpool, "nvidia_gpu_count", lambda: 0)
    monkeypatch.setattr(hostpool, "_pageable_warned", hostpool.threading.Event())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hostpool.HostPool()  # no GPU: pageable is simply what there is
