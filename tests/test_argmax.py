"""argmax_rows: the same picks as one NumPy argmax, whether the rows are split among threads or not, for any thread
count set."""

import numpy as np
import pytest

from kvrt.engine.argmax import DEFAULT_THREADS, PARALLEL_MIN_VALUES, argmax_rows, set_threads
from kvrt.errors import InvalidArgument


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("rows", [1, 3, 32, 33])
def test_picks_equal_numpys_on_both_paths(rows, threads):
    rng = np.random.default_rng(rows)
    try:
        set_threads(threads)
        for columns in (64, PARALLEL_MIN_VALUES // 3 + 1):  # one thread; split among threads (threads, rows > 1)
            matrix = rng.standard_normal((rows, columns), dtype=np.float32)
            assert np.array_equal(argmax_rows(matrix), matrix.argmax(axis=1))
    finally:
        set_threads(DEFAULT_THREADS)


def test_ties_pick_the_first_maximum_like_llamas_greedy_sampler():
    matrix = np.zeros((16, PARALLEL_MIN_VALUES // 8), dtype=np.float32)
    matrix[:, 5] = matrix[:, 9] = 1.0  # two maxima a row
    matrix[7, 2] = 1.0
    expected = np.full(16, 5)
    expected[7] = 2
    for threads in (1, 4):
        try:
            set_threads(threads)
            assert np.array_equal(argmax_rows(matrix), expected)
        finally:
            set_threads(DEFAULT_THREADS)


def test_a_thread_count_below_one_is_refused_and_the_pool_kept():
    matrix = np.random.default_rng(0).standard_normal((8, PARALLEL_MIN_VALUES // 4), dtype=np.float32)
    with pytest.raises(InvalidArgument, match="argmax threads"):
        set_threads(0)
    assert np.array_equal(argmax_rows(matrix), matrix.argmax(axis=1))
