"""Property-based fuzzing of the public API's argument checking: a result or a KvrtError, nothing else.

Every strategy mixes valid values with the wrong types and edge values a caller might
pass (NaN, bools for ints, bytes for text, lone surrogates, huge numbers). Valid calls
that do real work stay tiny (the generated test model, a few tokens) so the "ci"
profile runs in seconds.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrt.accounting.ledger import VramLedger
from kvrt.branching.branches import Branch, fanout
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import KvrtError
from kvrt.state.contextpool import ContextPool
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import MAGIC, VERSION, Snapshot

JUNK = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
    st.sampled_from(["\ud800", "", " ", "auto", np.int64(3), np.float32(0.5), 1j, object()]),
)
SMALL_INT = st.integers(-2, 6)


def result_or_kvrt_error(call):
    """Run ``call``: it returns, or raises a KvrtError (any other exception fails the test)."""
    try:
        return call()
    except KvrtError:
        return None


fuzz = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], deadline=None)


# -- parameter objects --------------------------------------------------------------------
def some_fields_wrong(fields: list[str]):
    """Keyword arguments where one or two fields get a fuzzed value and the rest keep their defaults,
    so every check is reached (the first wrong field would otherwise hide the later ones)."""
    return st.dictionaries(st.sampled_from(fields), st.one_of(SMALL_INT, st.floats(-2, 3), JUNK), max_size=2)


@fuzz
@given(kwargs=some_fields_wrong(["max_tokens", "stop", "sampling"]),
       stop=st.lists(st.one_of(st.text(max_size=3), JUNK), max_size=2))
def test_generation_params(kwargs, stop):
    for attempt in (kwargs, {**kwargs, "stop": stop}):
        params = result_or_kvrt_error(lambda attempt=attempt: GenerationParams(**attempt))
        if params is not None:
            assert type(params.max_tokens) is int and params.max_tokens >= 1
            assert isinstance(params.stop, tuple) and all(isinstance(s, str) and s for s in params.stop)
            assert isinstance(params.sampling, SamplingParams)


@fuzz
@given(kwargs=some_fields_wrong(["temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
                                 "frequency_penalty", "presence_penalty", "penalty_last_n", "grammar"]))
def test_sampling_params(kwargs):
    params = result_or_kvrt_error(lambda: SamplingParams(**kwargs))
    if params is not None:
        assert 0.0 <= params.temperature < float("inf") and 0.0 < params.top_p <= 1.0 and 0.0 <= params.min_p < 1.0
        assert type(params.top_k) is int and type(params.seed) is int and type(params.penalty_last_n) is int
        assert params.grammar is None or (isinstance(params.grammar, str) and params.grammar.strip())


@fuzz
@given(kwargs=some_fields_wrong(["n_ctx", "n_batch", "n_ubatch", "n_seq_max", "kv_unified", "n_threads",
                                 "flash_attn", "offload_kqv", "swa_full"]))
def test_context_params(kwargs):
    params = result_or_kvrt_error(lambda: ContextParams(**kwargs))
    if params is not None:
        params.to_c()


# -- fan-out --------------------------------------------------------------------------------
@fuzz
@given(prompt=st.one_of(st.text(max_size=6), JUNK), params=st.one_of(st.just(GenerationParams(max_tokens=1)), JUNK),
       name=st.one_of(st.text(max_size=4), JUNK))
def test_branch(prompt, params, name):
    result_or_kvrt_error(lambda: Branch(prompt, params, name))


DOCUMENTS = st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 600), max_size=8), JUNK)
BRANCHES = st.one_of(
    st.lists(st.one_of(st.builds(Branch, st.text(min_size=1, max_size=4).filter(str.strip),
                                 st.builds(GenerationParams, max_tokens=st.integers(1, 2))),
                       st.text(max_size=4), JUNK), max_size=3),
    JUNK,
)


@fuzz
@given(document=DOCUMENTS, branches=BRANCHES, mode=st.one_of(st.sampled_from(["auto", "isolated", "shared"]), JUNK),
       fork=st.one_of(st.sampled_from(["during_prefill", "after_prefill"]), JUNK),
       exact=st.one_of(st.booleans(), JUNK), n_batch=st.one_of(st.integers(1, 64), JUNK),
       max_ctx=st.one_of(st.none(), st.integers(1, 2048), JUNK))
def test_fanout(tiny_model, document, branches, mode, fork, exact, n_batch, max_ctx):
    # ``str`` branches get the default 128 tokens: keep them cheap by giving valid ones one token
    if isinstance(branches, list):
        branches = [Branch(b, GenerationParams(max_tokens=1)) if isinstance(b, str) and b.strip() and
                    "\ud800" not in b else b for b in branches]
    result = result_or_kvrt_error(lambda: fanout(tiny_model, document, branches, mode=mode, fork=fork, exact=exact,
                                                 n_batch=n_batch, max_ctx=max_ctx))
    if result is not None:
        assert len(result.branches) == len(branches) and result.mode in ("isolated", "shared")


@fuzz
@given(prompt=DOCUMENTS, max_tokens=st.integers(1, 2))
def test_generate(tiny_model, prompt, max_tokens):
    with Context(tiny_model, n_ctx=256) as ctx:
        done = result_or_kvrt_error(lambda: generate(ctx, prompt, GenerationParams(max_tokens=max_tokens)))
        if done is None:
            assert ctx.seq_len(0) == 0  # a refusal decoded nothing
        else:
            assert 1 <= len(done.tokens) + (done.finish_reason == "eog") <= max_tokens + 1


@fuzz
@given(params=st.one_of(st.just(ContextParams(n_ctx=256)), JUNK), max_idle=st.one_of(SMALL_INT, JUNK))
def test_context_pool(tiny_model, params, max_idle):
    pool = result_or_kvrt_error(lambda: ContextPool(tiny_model, params, max_idle=max_idle))
    if pool is not None:
        pool.close()


# -- snapshot files -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_file(tiny_model, tmp_path_factory) -> Path:
    """A real snapshot file of a short document."""
    with Context(tiny_model, n_ctx=256) as ctx:
        prefill(ctx, tiny_model.tokenize("a short document"), logits_last=False)
        with Snapshot.capture(ctx) as snap:
            return snap.save(tmp_path_factory.mktemp("fuzz") / "real.kvs")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "file.kvs"


def load_checked(path: Path, data: bytes) -> None:
    """Loading ``data`` gives a snapshot or a KvrtError, and never leaves pool memory held."""
    path.write_bytes(data)
    pool = HostPool(pinned=False, max_bytes=1 << 24)
    snap = result_or_kvrt_error(lambda: Snapshot.load(path, pool))
    if snap is not None:
        snap.release()
    assert pool.stats.bytes_in_use == 0


@fuzz
@given(data=st.binary(max_size=300))
def test_loading_random_bytes(scratch, data):
    load_checked(scratch, data)


@fuzz
@given(data=st.binary(max_size=64))
def test_loading_random_bytes_after_a_valid_prefix(scratch, data):
    load_checked(scratch, struct.pack("<8sII", MAGIC, VERSION, len(data)) + data)


@fuzz
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 10**6)))
def test_loading_a_damaged_real_file(real_file, scratch, edits, cut):
    data = bytearray(real_file.read_bytes())
    for at, value in edits:
        data[at % len(data)] = value
    load_checked(scratch, bytes(data[:cut % len(data)] if cut is not None else data))


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)


@fuzz
@given(path=st.lists(st.sampled_from(["fingerprint", "layout", "n_tokens", "nbytes", "tokens_hash", "n_layer",
                                      "flash_attn", "content", "extra"]), min_size=1, max_size=2),
       value=JSON, delete=st.booleans())
def test_loading_a_consistent_file_with_an_edited_header(real_file, scratch, path, value, delete):
    """The checksum is recomputed, so only the header's own checks stand between the edit and a restore."""
    saved = real_file.read_bytes()
    prefix = struct.Struct("<8sII")
    header_len = prefix.unpack_from(saved)[2]
    header = json.loads(saved[prefix.size:prefix.size + header_len])
    payload = saved[prefix.size + header_len:-16]
    node = header
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        if delete:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
    body = json.dumps(header).encode()
    head = prefix.pack(MAGIC, VERSION, len(body))
    load_checked(scratch, head + body + payload + hashlib.blake2b(head[8:] + body + payload, digest_size=16).digest())


@fuzz
@given(path=st.one_of(st.text(max_size=10), JUNK))
def test_load_and_save_paths(real_file, path):
    """Any path: loaded, saved (inside a scratch folder when it is a plain relative name) or refused."""
    result_or_kvrt_error(lambda: Snapshot.load(path))
    if isinstance(path, str):
        if "/" in path or path in ("", ".", ".."):
            return  # never write outside the scratch folder
        folder = real_file.parent / "saved"
        folder.mkdir(exist_ok=True)
        path = folder / path
    with Snapshot.load(real_file) as snap:
        result_or_kvrt_error(lambda: snap.save(path))


# -- ledger and host pool -------------------------------------------------------------------
@fuzz
@given(capacity=st.one_of(st.integers(-1, 10**6), JUNK), admit_percent=st.one_of(st.floats(-1, 101), JUNK),
       reconcile=st.one_of(st.none(), JUNK), nbytes=st.one_of(st.integers(-1, 10**6), JUNK),
       owner=st.one_of(st.text(max_size=4), JUNK))
def test_ledger_calls(capacity, admit_percent, reconcile, nbytes, owner):
    ledger = result_or_kvrt_error(lambda: VramLedger(capacity, admit_percent=admit_percent,
                                                     reconcile_every_s=reconcile))
    if ledger is None:
        return
    held = result_or_kvrt_error(lambda: ledger.try_reserve(nbytes, owner))
    for call in (lambda: ledger.fits(nbytes), lambda: ledger.resize(held, nbytes),
                 lambda: ledger.transfer(held, owner), lambda: ledger.release(held), lambda: ledger.release(nbytes)):
        result_or_kvrt_error(call)
    snap = ledger.snapshot()
    assert 0 <= snap.allocated_bytes <= snap.max_bytes
    assert snap.allocated_bytes == sum(n for _, _, n in snap.reservations)
    ledger.close()


@fuzz
@given(nbytes=st.one_of(st.integers(-1, 1 << 30), JUNK), max_bytes=st.one_of(st.none(), st.integers(-1, 1 << 20),
                                                                            JUNK))
def test_host_pool_calls(nbytes, max_bytes):
    pool = result_or_kvrt_error(lambda: HostPool(pinned=False, max_bytes=1 << 20 if max_bytes is None else max_bytes))
    if pool is None:
        return
    buffer = result_or_kvrt_error(lambda: pool.acquire(nbytes))
    if buffer is not None:
        assert buffer.view.nbytes == nbytes
        buffer.release()
    assert pool.stats.bytes_in_use == 0
