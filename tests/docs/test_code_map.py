"""docs/design/architecture.md names real files: the code map must follow the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "design" / "architecture.md"


def _named_paths(text: str) -> list[str]:
    """Backticked tokens that name a file or folder (``x.py``, ``a/b/``, ``vllm_omni/...``)."""
    tokens = re.findall(r"`([^`\s]+)`", text)
    return [t for t in tokens if t.endswith((".py", "/")) or t.startswith(("vllm_omni/", "tests/"))]


def _exists(token: str) -> bool:
    if token.startswith(("vllm_omni/", "tests/")):
        return (ROOT / token).exists()
    # a short name (``routes/``, ``cache.py``): some file or folder of the package ends with it
    suffix = token.rstrip("/")
    return any(str(p.relative_to(ROOT)).endswith(suffix) for p in (ROOT / "vllm_omni").rglob("*"))


def test_every_path_on_the_code_map_exists():
    names = _named_paths(PAGE.read_text())
    assert len(names) > 30, "the code map names the files it describes"
    missing = [n for n in names if not _exists(n)]
    assert not missing, f"docs/design/architecture.md names paths that do not exist: {missing}"


def test_the_check_sees_a_missing_path():
    assert not _exists("vllm_omni/no_such_module.py")
    assert not _exists("no_such_folder/")
    assert _named_paths("see `vllm_omni/errors.py` and `routes/` but not `Omni`") == [
        "vllm_omni/errors.py",
        "routes/",
    ]
