"""argmax_rows: the same picks as one NumPy argmax, whether the rows are split among threads or not."""

import numpy as np
import pytest
from kvrt.engine.argmax import PARALLEL_MIN_VALUES, argmax_rows


@pytest.mark.parametrize("rows", [1, 3, 32, 33])
def test_picks_equal_numpys_on_both_paths(rows):
    rng = np.random.default_rng(rows)
    for columns in (64, PARALLEL_MIN_VALUES // 3 + 1):  # one thread; split among threads (rows > 2)
        matrix = rng.standard_normal((rows, columns), dtype=np.float32)
        assert np.array_equal(argmax_rows(matrix), matrix.argmax(axis=1))


def test_ties_pick_the_first_maximum_like_llamas_greedy_sampler():
    matrix = np.zeros((16, PARALLEL_MIN_VALUES // 8), dtype=np.float32)
    matrix[:, 5] = matrix[:, 9] = 1.0  # two maxima a row
    matrix[7, 2] = 1.0
    expected = np.full(16, 5)
    expected[7] = 2
    assert np.array_equal(argmax_rows(matrix), expected)
