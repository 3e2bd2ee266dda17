"""Qwen3-Omni's stages beyond the thinker (talker, code2wav), run with transformers."""
