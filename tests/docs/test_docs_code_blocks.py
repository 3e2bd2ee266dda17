"""Every fenced code block in ``docs/**/*.md`` runs (or is explicitly marked as not runnable).

One test per page: its blocks run in order in one namespace, on the tiny models, so a page can
build an engine in one block and use it in the next. See ``doc_blocks`` for the conventions
(placeholder paths, languages, ``<!-- docs-test: ... -->`` markers).
"""

from __future__ import annotations

import signal

import pytest
from doc_blocks import DOCS_DIR, PageRunner, doc_pages, extract_blocks

PAGE_TIMEOUT_S = 300
PAGES = [str(p.relative_to(DOCS_DIR)) for p in doc_pages()]


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks(page, docs_assets_root, tmp_path, monkeypatch):
    monkeypatch.delenv(
        "VLLM_CPU_KVCACHE_SPACE", raising=False
    )  # as in a fresh shell: the budget is automatic
    blocks = extract_blocks(DOCS_DIR / page)
    runner = PageRunner(page, docs_assets_root, tmp_path)

    def _timeout(signum, frame):
        raise TimeoutError(f"docs/{page}: blocks still running after {PAGE_TIMEOUT_S}s")

    old = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(PAGE_TIMEOUT_S)
    try:
        runner.run(blocks)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    for skipped in runner.skipped:
        print(f"not run: {skipped}")


def test_marker_and_placeholder_rules(tmp_path):
    """The checker itself: unknown markers, skip without reason, unknown placeholders, plain blocks."""
    from doc_blocks import Block, substitute

    page = DOCS_DIR / "_probe_never_committed.md"
    try:
        page.write_text("<!-- docs-test: skpi typo -->\n```bash\necho\n```\n")
        with pytest.raises(ValueError, match="unknown docs-test marker"):
            extract_blocks(page)
    finally:
        page.unlink()
    runner = PageRunner("probe.md", tmp_path, tmp_path)
    with pytest.raises(AssertionError, match="needs a reason"):
        runner.run_block(Block("probe.md", 1, "bash", "echo\n", {"skip": ""}))
    with pytest.raises(AssertionError, match="cannot check `echo hi`"):
        runner.run_block(Block("probe.md", 1, "bash", "echo hi\n"))
    with pytest.raises(AssertionError, match="cannot run a 'plain' block"):
        runner.run_block(Block("probe.md", 1, "", "x\n"))
    with pytest.raises(AssertionError, match="unknown placeholder"):
        substitute("Omni('/path/to/nowhere')", tmp_path, None, "probe.md:1")
    with pytest.raises(AssertionError, match="no server was started"):
        substitute("curl localhost:8000/health", tmp_path, None, "probe.md:1")
