"""In-tree diffusion denoisers built on vLLM tensor-parallel layers."""
