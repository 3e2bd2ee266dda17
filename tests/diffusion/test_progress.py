"""Denoising progress reaches the log when stderr is not a terminal (issue 23 item 5)."""

from __future__ import annotations

import io
import logging

from vllm_omni.diffusion import progress
from vllm_omni.diffusion.progress import step_progress


def test_log_lines_without_a_terminal(caplog, monkeypatch):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())  # not a TTY, as under a server
    with caplog.at_level(logging.INFO, logger="vllm_omni.diffusion.progress"):
        assert list(step_progress(range(4), 4, "denoise")) == [0, 1, 2, 3]
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith(
            "denoise: step 4/4, "
        )  # quick loop: the last line only
        caplog.clear()
        monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
        assert list(step_progress(iter("abc"), 3, "denoise")) == ["a", "b", "c"]
        assert [r.getMessage().split(",")[0] for r in caplog.records] == [
            "denoise: step 1/3",
            "denoise: step 2/3",
            "denoise: step 3/3",
        ]
        caplog.clear()
        assert list(step_progress(range(3), 3, "denoise", enabled=False)) == [0, 1, 2]
        assert caplog.records == []


def test_the_line_comes_after_the_step_ran(caplog, monkeypatch):
    """A line reports finished steps: it is written when the caller asks for the next one."""
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    seen = []
    with caplog.at_level(logging.INFO, logger="vllm_omni.diffusion.progress"):
        for step in step_progress(range(2), 2, "denoise"):
            seen.append((step, len(caplog.records)))
    assert seen == [(0, 0), (1, 1)] and len(caplog.records) == 2


def test_a_terminal_gets_a_tqdm_bar(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    fake = Tty()
    monkeypatch.setattr(progress.sys, "stderr", fake)
    monkeypatch.setattr(progress, "tqdm", lambda it, total, desc: (fake.write(f"{desc} bar {total}"), it)[1])
    assert list(step_progress(range(2), 2, "denoise")) == [0, 1]
    assert fake.getvalue() == "denoise bar 2"
