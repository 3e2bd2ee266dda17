"""Stage runtimes (vLLM engines for LLM stages, the diffusion engine) and the orchestrator."""
