"""Every fenced code block of the README and ``docs/**/*.md`` runs (or is explicitly marked as not runnable).

One test per page: its blocks run in order, on the tiny models; each Python block is a script
of its own in a new process with vLLM's default multiprocessing, and a documented server runs
as its own process for the curl and client blocks after it. Nothing is bounded by a page-wide
clock: each process is waited on while it makes progress (``doc_blocks.wait_on_progress``).
See ``doc_blocks`` for the conventions (placeholder paths, languages, ``<!-- docs-test: ... -->``
markers).
"""

from __future__ import annotations

import pytest
from doc_blocks import REPO_ROOT, PageRunner, doc_pages, extract_blocks

PAGES = [str(p.relative_to(REPO_ROOT)) for p in doc_pages()]


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks(page, docs_assets_root, tmp_path):
    blocks = extract_blocks(REPO_ROOT / page)
    runner = PageRunner(page, docs_assets_root, tmp_path)
    runner.run(blocks)
    for skipped in runner.skipped:
        print(f"not run: {skipped}")


def test_marker_and_placeholder_rules(tmp_path):
    """The checker itself: unknown markers, skip without reason, unknown placeholders, plain blocks."""
    from doc_blocks import Block, substitute

    page = REPO_ROOT / "docs" / "_probe_never_committed.md"
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


def test_python_blocks_run_as_scripts_and_wait_on_progress(tmp_path, monkeypatch):
    """A block is a script (its own names, `__main__` guard); a failing block shows its output; a
    block is failed for stalling (no output, no CPU time), never for taking long while progressing."""
    import doc_blocks
    from doc_blocks import Block

    runner = PageRunner("probe.md", tmp_path, tmp_path)

    def run(*blocks):
        for block in blocks:
            runner.run_block(block)
        runner.flush()

    with pytest.raises(AssertionError, match="needs `if __name__"):
        run(Block("probe.md", 3, "python", 'from vllm_omni import Omni\nomni = Omni("/path/to/model")\n'))
    with pytest.raises(
        AssertionError, match=r"(?s)probe.md:4: .*exited with 1.*block_4.py\", line 5.*NameError: name 'omni'"
    ):
        run(Block("probe.md", 4, "python", "print(omni)\n"))
    # a `continues` block is the same script, at its own page lines
    run(
        Block("probe.md", 2, "python", "x = 1\n"),
        Block("probe.md", 6, "python", "assert x == 1\n", {"continues": ""}),
    )
    with pytest.raises(AssertionError, match=r"(?s)block_2.py\", line 7.*ZeroDivisionError"):
        run(
            Block("probe.md", 2, "python", "x = 0\n"),
            Block("probe.md", 6, "python", "1 / x\n", {"continues": ""}),
        )
    with pytest.raises(AssertionError, match="no Python block before it"):
        run(Block("probe.md", 6, "python", "pass\n", {"continues": ""}))
    # Only time asleep counts toward a stall (every thread sleeping, no output, no CPU), so these
    # bounds are the scripts' own sleeps, never the machine's load: between two lines the ticking
    # script sleeps 0.3 s, a fifth of the bound, however long it waits for a CPU or takes to exit.
    monkeypatch.setattr(doc_blocks, "STALL_S", 1.5)
    ticking = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.3)\n"
    run(Block("probe.md", 1, "python", ticking))  # 2.4 s > STALL_S, never asleep for long
    assert runner.seconds["probe.md:1"] > 1.5
    with pytest.raises(AssertionError, match=r"(?s)every thread asleep for 2 s \(stalled\).*started"):
        run(Block("probe.md", 9, "python", "import time\nprint('started', flush=True)\ntime.sleep(600)\n"))


def test_a_tree_waiting_for_a_cpu_is_not_stalled(tmp_path, monkeypatch):
    """Time the process tree spends runnable without a CPU (a loaded machine: ``busy``) or exiting
    never counts toward :data:`doc_blocks.STALL_S`, however long it lasts."""
    import doc_blocks
    from doc_blocks import Block

    monkeypatch.setattr(doc_blocks, "STALL_S", 0.5)
    monkeypatch.setattr(doc_blocks, "_tree_sample", lambda pid: (0.0, True))  # starved: no CPU time gained
    runner = PageRunner("probe.md", tmp_path, tmp_path)
    runner.run_block(Block("probe.md", 1, "python", "import time\ntime.sleep(2)\n"))
    runner.flush()
    assert runner.seconds["probe.md:1"] > 4 * doc_blocks.STALL_S
