"""tools/replay_gpu_steps.py: issue 24's workloads through the engine on the CPU, with a GPU's step times modelled.

References: the fewest prompt tokens a workload can be prefilled with (every shared prefix and history computed
once), and the step-time model written out by hand for one-micro-batch steps.
"""

from __future__ import annotations

import pytest

from repo_tools import load_tool


def _tool():
    return load_tool("replay_gpu_steps")


def test_a_step_costs_a_weight_pass_a_micro_batch_its_tokens_and_the_kv_it_reads():
    tool = _tool()
    parts, ms = tool.step_ms([(0, 512)], {0: 1000}, n_ubatch=512)
    assert parts == 1 and ms == pytest.approx(tool.PASS_MS + 512 * tool.TOKEN_MS
                                              + 1512 * tool.CELL_BYTES / tool.KV_BYTES_PER_MS)
    parts, _ = tool.step_ms([(0, 1), (2, 1)], {0: 10, 2: 10}, n_ubatch=512)  # a gap between slots: two runs
    assert parts == 2
    parts, ms = tool.step_ms([(0, 1), (2, 1)], {}, n_ubatch=512, pool_cells=300)  # one pool: one pass over it
    assert parts == 1 and ms == pytest.approx(tool.PASS_MS + 2 * tool.TOKEN_MS
                                              + 300 * tool.CELL_BYTES / tool.KV_BYTES_PER_MS)


@pytest.mark.parametrize("shared", [0, 150])
def test_a_replay_prefills_every_prefix_once_and_loses_no_token(shared):
    tool = _tool()
    sizes = tool.Sizes(shared=shared, own=60, turns=2, append=16)
    agents = 4
    result = tool.replay("private", agents=agents, cells=agents * 512, sizes=sizes)
    fewest = shared + agents * sizes.own + agents * (sizes.turns - 1) * (sizes.append + 1)  # +1: the reply's last
    assert (result.lost, result.stats.prefilled_tokens) == (0, fewest)
    assert result.steps == result.stats.steps and result.micro_batches >= result.steps and result.modelled_s > 0
