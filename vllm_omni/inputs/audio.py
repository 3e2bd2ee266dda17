"""Per-request parameters of an audio (waveform) stage, such as Qwen2.5-Omni's code2wav."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AudioParams:
    """Per-request parameters of the code2wav stage.

    Attributes:
        voice: a speaker of ``spk_dict.pt`` (``None``: the first one, as transformers' default
            ``"Chelsie"`` is the first of the released checkpoint).
        seed: seeds the DiT's starting noise (``None``: unseeded).
        num_steps: ODE steps of the flow-matching DiT (transformers' default 10).
        guidance_scale: classifier-free guidance of the DiT (default 0.5).
        sway_coefficient: time-step sway of the DiT (default -1.0).
    """

    voice: str | None = None
    seed: int | None = None
    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
