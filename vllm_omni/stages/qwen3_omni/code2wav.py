"""Qwen3-Omni's code2wav stage: multi-codebook codec codes -> waveform, with transformers.

The stage runs transformers' own ``Qwen3OmniMoeCode2Wav`` (a sliding-window transformer over the
summed codebook embeddings, then causal upsampling convolutions) in float32 on one driver thread,
one request at a time, through ``chunked_decode`` with the chunking transformers' Omni
``generate`` uses (300 codes, 25 codes of left context). Its weights are the ``code2wav.*``
tensors of the checkpoint. Deterministic (no noise): ``AudioParams``' ``voice`` is the talker's
business and ``seed`` / ``num_steps`` / ``guidance_scale`` / ``sway_coefficient`` do not apply.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.stages.model_driver import ModelStageDriver, load_submodule
from vllm_omni.stages.qwen2_5_omni.code2wav import AudioOutput

#: Samples per second of Qwen3-Omni's code2wav output (the model card's 24 kHz; not in the config).
SAMPLE_RATE = 24000
#: ``chunked_decode``'s chunk and left context (codes), as transformers' ``generate`` calls it.
CHUNK, LEFT_CONTEXT = 300, 25


class Code2WavStageEngine(ModelStageDriver):
    """Runs Qwen3-Omni's code2wav: ``submit`` -> future of
    :class:`~vllm_omni.stages.qwen2_5_omni.code2wav.AudioOutput` (``SAMPLE_RATE`` Hz; its
    ``codes`` are the int64 ``[num_quantizers, N]`` it was made from).

    Raises:
        StageEngineError: no model directory, or the checkpoint cannot be loaded.
    """

    kind = "code2wav"
    params_type = AudioParams

    def load(self, model_dir: str) -> None:
        """transformers' code2wav and the talker's voices."""
        config = AutoConfig.from_pretrained(model_dir)
        self.model = load_submodule(Qwen3OmniMoeCode2Wav, config.code2wav_config, model_dir, "code2wav.")
        self.voices = sorted(str(k).lower() for k in (config.talker_config.speaker_id or {}))
        self.groups = config.code2wav_config.num_quantizers
        self.codebook = config.code2wav_config.codebook_size

    def validate_request(self, request: StageRequest) -> None:
        """``AudioParams`` (a known voice, if any), the talker's payload of ``[G, N]`` codes, no adapter."""
        voice = (
            None if request.params is None or request.params.voice is None else request.params.voice.lower()
        )
        self.check_request(request, AudioParams, "talker", voice, self.voices)
        prompt = request.prompt
        if prompt is None:
            return
        codes = prompt.tensor("codes", consumer=self.stage.label)
        if codes.dim() != 2 or codes.shape[0] != self.groups:
            raise InvalidRequestError(
                f"{self.stage.label}: codes must be [{self.groups}, N] (one row per codebook), got {list(codes.shape)}"
            )
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
            raise InvalidRequestError(f"{self.stage.label}: codes must lie in [0, {self.codebook})")

    def prepare(self, request: StageRequest) -> torch.Tensor:
        return request.prompt.tensor("codes", consumer=self.stage.label).long()

    @torch.inference_mode()
    def run(self, codes: torch.Tensor) -> AudioOutput:
        """One waveform from ``codes`` (int64 ``[num_quantizers, N]``)."""
        if codes.shape[-1] == 0:
            wav = torch.zeros(0)
        else:
            wav = self.model.chunked_decode(codes[None], chunk_size=CHUNK, left_context_size=LEFT_CONTEXT)
        waveform = wav.reshape(-1).float().numpy().astype(np.float32, copy=True)
        return AudioOutput(waveform, SAMPLE_RATE, codes.clone())
