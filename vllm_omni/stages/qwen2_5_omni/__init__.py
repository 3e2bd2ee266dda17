"""Qwen2.5-Omni stages beyond the thinker (talker, code2wav) and their hand-offs (``pipeline.py``)."""
