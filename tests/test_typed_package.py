"""kvrt is a typed package: an installed kvrt gives a user's ``mypy --strict`` real types, not Any.

Checked against a regular (wheel) install in a fresh virtual environment, which is what a
user's ``pip install kvrt`` gives; setuptools' editable installs of a package-dir layout go
through an import hook that type checkers cannot follow (DEVELOPING.md says what to do there).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_SCRIPT = '''
import kvrt
from kvrt import Branch, GenerationParams, Model


def answers(path: str) -> list[str]:
    with Model(path, n_gpu_layers=0) as model:
        result = kvrt.fanout(model, "a document", [Branch("a question", GenerationParams(max_tokens=4))])
        return [branch.text for branch in result.branches]
'''
WRONG = '''
from kvrt import Model

count: int = Model("m.gguf")
'''


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mypy")
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
                   check=True, timeout=300, capture_output=True)
    return python


def _mypy(python: Path, tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user_script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-executable",
                           str(python), str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_mypy_strict_accepts_a_user_script(installed_python: Path, tmp_path: Path) -> None:
    done = _mypy(installed_python, tmp_path, USER_SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_sees_real_types_not_any(installed_python: Path, tmp_path: Path) -> None:
    done = _mypy(installed_python, tmp_path, WRONG)
    assert done.returncode == 1
    assert 'Incompatible types in assignment (expression has type "Model", variable has type "int")' in done.stdout
