"""OpenAI-compatible HTTP server over :class:`~vllm_omni.entrypoints.async_omni.AsyncOmni`."""
