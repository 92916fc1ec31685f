"""One model-geometry type: a generated model's spec and its GGUF header read back agree on it."""

from __future__ import annotations

import pytest

from kvrt.accounting.estimate import ModelShape
from kvrt.engine.geometry import ModelGeometry
from kvrt.errors import InvalidArgument
from kvrt.modelfiles.testmodels import PRESETS


def geometry_of(shape: ModelGeometry) -> ModelGeometry:
    return ModelGeometry(shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv, shape.n_vocab,
                         shape.key_length, shape.value_length)


def test_a_written_model_reads_back_as_the_geometry_it_was_written_with(tiny_model_path):
    read = ModelShape.read(tiny_model_path)
    assert geometry_of(read) == geometry_of(PRESETS["tiny"])
    # per token: every layer's K and V, n_head_kv heads of head_dim F16 values each
    tiny = PRESETS["tiny"]
    assert read.kv_bytes_per_token() == tiny.n_layer * 2 * tiny.n_head_kv * (tiny.n_embd // tiny.n_head) * 2


def test_per_head_lengths_default_to_the_head_size_and_can_differ():
    assert ModelGeometry(2, 640, 4, 1, 10).key_length == 160
    gemma_like = ModelGeometry(18, 640, 4, 1, 262144, key_length=256, value_length=256)
    assert (gemma_like.head_dim, gemma_like.kv_bytes_per_token()) == (160, 18 * 1 * 512 * 2)


@pytest.mark.parametrize("fields, says", [
    (dict(n_layer=0), "n_layer"),
    (dict(n_head=0), "n_head"),
    (dict(n_head=6, n_head_kv=4), "multiple of n_head_kv"),
    (dict(n_vocab=-1), "n_vocab"),
    (dict(key_length=True), "key_length"),
    (dict(n_embd=2.5), "n_embd"),
])
def test_impossible_geometries_are_refused_naming_the_field(fields, says):
    base = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=10)
    with pytest.raises(InvalidArgument, match=says):
        ModelGeometry(**(base | fields))
