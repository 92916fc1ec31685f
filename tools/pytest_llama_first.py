#!/usr/bin/env python3
"""Run pytest with llama.cpp mapped before anything imports NumPy.

A CUDA build of llama.cpp segfaults on model load when NumPy was imported first
(see kvrt/__init__.py and tools/probe_import_order.py); pytest's plugins import NumPy
early, so GPU test runs go through this wrapper:  python3 tools/pytest_llama_first.py ARGS
"""

import sys

import pytest

import kvrt  # noqa: F401  (maps llama.cpp first)

sys.exit(pytest.main(sys.argv[1:]))
