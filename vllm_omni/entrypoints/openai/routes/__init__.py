"""Route families of the OpenAI-compatible server, one ``APIRouter`` per module.

``chat`` (chat completions, completions), ``images`` (generations, edits), ``videos``,
``models`` (models list, health) and ``adapters`` (runtime LoRA load/unload); ``common``
holds what they share.
"""
