"""Request outputs of a pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OmniRequestOutput:
    """The output of one stage of one request, as returned to the caller.

    Attributes:
        request_id: id of the pipeline request (shared by all its stages).
        stage_id: the stage that produced this output.
        final_output_type: ``"text"`` (LLM stage), ``"image"`` (diffusion stage), ``"video"``
            (diffusion stage running a video pipeline), ``"audio"`` (a waveform stage such as
            Qwen2.5-Omni's code2wav) or ``"codec"`` (codec tokens, such as Qwen2.5-Omni's talker
            makes: in ``stage_outputs``), as the stage describes its output.
        prompt: the prompt this stage received.
        request_output: the stage's vLLM ``RequestOutput`` (LLM stages), else ``None``.
        images: PIL images (diffusion stages), else empty (also for video pipelines).
        videos: video pipelines: one list of PIL frames per video, else empty.
        latents: final latents of a diffusion stage, float32 CPU ``(num_images_per_prompt, C, h, w)``
            when the pipeline exposes them (in-tree always; diffusers fallback for ``output_type="latent"``).
        audio: audio stages: the waveform, a 1-D ``numpy.float32`` array of samples in [-1, 1]
            (mono), else ``None``.
        sample_rate: samples per second of ``audio`` (Hz), else ``None``.
        stage_outputs: every stage's raw output for this request, by stage id.
    """

    request_id: str
    stage_id: int
    final_output_type: str
    prompt: Any = None
    request_output: Any = None
    images: list = field(default_factory=list)
    latents: Any = None
    videos: list = field(default_factory=list)
    audio: Any = None
    sample_rate: int | None = None
    stage_outputs: dict[int, Any] = field(default_factory=dict, repr=False)

    @property
    def text(self) -> str | None:
        """Generated text of the first completion (LLM stages)."""
        if self.request_output is None or not self.request_output.outputs:
            return None
        return self.request_output.outputs[0].text

    @property
    def token_ids(self) -> list[int] | None:
        """Generated token ids of the first completion (LLM stages)."""
        if self.request_output is None or not self.request_output.outputs:
            return None
        return list(self.request_output.outputs[0].token_ids)
