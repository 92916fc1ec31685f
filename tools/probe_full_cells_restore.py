"""Does a restore that keeps the sliding window's masked cells continue exactly past the window?

kvrt's sequence snapshots (``llama_state_seq_get_data_ext``) leave out the cells a sliding
window masks, so a restore packs the window's cells at other slots than the prefill did and
greedy outputs can flip at near-ties. llama.cpp's whole-context state of a one-sequence
context keeps every cell; this probe gives its memory part the sequence-state header (taken
from the same context) and restores it with ``llama_state_seq_set_data_ext``, which places
the cells at slots 0..n-1 and continues at n, as the prefill did. For each question it prints
whether the sequence snapshot and the full-cells restore continue like the prefill context.

The header swap relies on this llama.cpp build's state layout (whole: a length-prefixed
architecture name; sequence: 8 bytes), which the probe checks on the two states it reads.

    python tools/probe_full_cells_restore.py
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy is imported)
from __future__ import annotations

import kvrt  # noqa: F401
from kvrt.bindings import ffi, lib
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.engine.model import Model
from kvrt.modelfiles.demo_model import demo_model_path, license_terms_text
from kvrt.state.snapshot import Snapshot

QUESTIONS = [
    "\n\nThe obligations it places on distributors are:\n1.",
    "\n\nSummary of section 3:",
    "\n\nA title for this text:",
    "\n\nThe most important word in the document is",
]


def main() -> None:
    model = Model(demo_model_path())
    text = license_terms_text()
    doc = model.tokenize(text[text.find("Gemma Terms of Use"):])[:934]
    params = ContextParams(n_ctx=1280, n_threads=2, flash_attn="off")
    gen = GenerationParams(max_tokens=24)
    prompts = [model.tokenize(q, add_special=False) for q in QUESTIONS]
    with Context(model, params) as ctx:
        prefill(ctx, doc, logits_last=False)
        snapshot = Snapshot.capture(ctx, tokens=doc)
        size = int(lib().llama_state_get_size(ctx.ptr))
        buffer = ffi.new("uint8_t[]", size)
        whole = bytes(ffi.buffer(buffer, int(lib().llama_state_get_data(ctx.ptr, buffer, size))))
        seq = bytearray(ctx.seq_state_size(0))
        seq = seq[:ctx.seq_state_get(0, seq)]
        reference = []
        for prompt in prompts:
            reference.append(generate(ctx, prompt, gen).tokens)
            ctx.seq_rm(0, len(doc), -1)
    arch = (model.meta("general.architecture") or "").encode()
    if whole[:4 + len(arch)] != len(arch).to_bytes(4, "little") + arch:
        raise SystemExit("this llama.cpp build's whole-context state does not start with the architecture name")
    full_cells = bytes(seq[:8]) + whole[4 + len(arch):]
    print(f"{len(doc)} document tokens; sequence state {len(seq)} bytes, full cells {len(full_cells)} bytes")
    for name, restore in (("sequence snapshot", lambda c: snapshot.restore(c)),
                          ("full cells", lambda c: c.seq_state_set(full_cells, 0))):
        same = []
        for prompt, want in zip(prompts, reference):
            with Context(model, params) as ctx:
                restore(ctx)
                same.append(generate(ctx, prompt, gen).tokens == want)
        print(f"{name}: {sum(same)} of {len(same)} continue like the prefill context {same}")
    snapshot.release()


if __name__ == "__main__":
    main()
