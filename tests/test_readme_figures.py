"""The README's results tables are exactly what tools/readme_tables.py renders from bench/results."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "tools" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("readme_tables", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_readme_tables_match_the_committed_data():
    tables = _tables()
    readme = tables.README.read_text()
    assert tables.render(readme) == readme, "run: python tools/readme_tables.py --write"


def test_every_row_is_backed_by_data_on_some_machine():
    tables = _tables()
    for row in tables.ROWS + tables.SIMULATED_ROWS:
        assert tables._has(row.h200, tables.H200) or tables._has(row.cpu, tables.CPU), row.what
