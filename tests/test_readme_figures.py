"""The README's results tables are exactly what tools/readme_tables.py renders from bench/results."""

from __future__ import annotations

from repo_tools import load_tool


def _tables():
    return load_tool("readme_tables")


def test_readme_tables_match_the_committed_data():
    tables = _tables()
    readme = tables.README.read_text()
    assert tables.render(readme) == readme, "run: python tools/readme_tables.py --write"


def test_every_row_is_backed_by_data_on_some_machine():
    tables = _tables()
    for row in tables.ROWS + tables.SIMULATED_ROWS:
        assert tables._has(row.h200, tables.H200) or tables._has(row.cpu, tables.CPU), row.what
