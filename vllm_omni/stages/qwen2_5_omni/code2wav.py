"""Qwen2.5-Omni's code2wav stage: codec tokens -> waveform with transformers' Token2Wav.

The stage runs transformers' own ``Qwen2_5OmniToken2WavModel`` (flow-matching DiT to a mel
spectrogram, then the BigVGAN vocoder) in float32 on one driver thread, one request at a
time, exactly as ``Qwen2_5OmniForConditionalGeneration.generate`` calls it per sample. Its
weights are the ``token2wav.*`` tensors of the Omni checkpoint; speakers come from the
checkpoint's ``spk_dict.pt`` (``{voice: {"cond", "ref_mel", "bos_token"}}``).

The DiT starts from ``torch.randn`` noise; a request's ``seed`` seeds it inside a forked RNG
(the global generator is untouched), so the same seed gives the same waveform as transformers
after ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import Qwen2_5OmniConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

from vllm_omni.errors import InvalidRequestError, StageEngineError
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.stages.model_driver import ModelStageDriver

#: Samples per second of Qwen2.5-Omni's vocoder output (the model card's 24 kHz; the config
#: does not carry it).
SAMPLE_RATE = 24000
SPEAKER_FILE = "spk_dict.pt"
_PREFIX = "token2wav."


@dataclass(frozen=True)
class AudioOutput:
    """A waveform: ``waveform`` 1-D ``numpy.float32`` samples (mono, nominally in [-1, 1]) at
    ``sample_rate`` Hz; ``codes`` the codec tokens it was made from (int64 ``[N]``)."""

    waveform: np.ndarray
    sample_rate: int
    codes: torch.Tensor


def load_speakers(model_dir: str) -> dict[str, dict[str, Any]]:
    """The speakers of an Omni checkpoint (``spk_dict.pt``, loaded with ``weights_only=True``).

    Raises:
        StageEngineError: the file is missing or unreadable.
    """
    path = os.path.join(model_dir, SPEAKER_FILE)
    try:
        return dict(torch.load(path, weights_only=True))
    except (OSError, RuntimeError, ValueError) as exc:
        raise StageEngineError(f"code2wav: cannot read speakers from {path}: {exc}") from exc


def load_token2wav(model_dir: str) -> torch.nn.Module:
    """transformers' ``Qwen2_5OmniToken2WavModel`` with the checkpoint's ``token2wav.*`` weights (float32, eval).

    Raises:
        StageEngineError: no Omni config, or the weights do not match the model.
    """
    config = Qwen2_5OmniConfig.from_pretrained(model_dir)
    model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config, torch_dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for key, value in load_file(path).items():
            if key.startswith(_PREFIX):
                state[key[len(_PREFIX) :]] = value.float()
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise StageEngineError(f"code2wav: token2wav weights of {model_dir} do not fit: {exc}") from exc
    return model.float().eval()


class Code2WavStageEngine(ModelStageDriver):
    """Runs the code2wav stage: ``submit(payload, AudioParams)`` -> future of :class:`AudioOutput`.

    The prompt is the talker's :class:`~vllm_omni.engine.connectors.StagePayload` whose
    ``"codes"`` tensor (int64 ``[N]``) holds the codec tokens before the talker's stop token.
    No LoRA: the LoRA management calls raise ``LoRANotEnabledError``.

    Raises:
        StageEngineError: no model directory, or the checkpoint cannot be loaded.
    """

    kind = "code2wav"
    params_type = AudioParams

    def load(self, model_dir: str) -> None:
        """transformers' Token2Wav and the checkpoint's speakers."""
        self.model = load_token2wav(model_dir)
        self.speakers = load_speakers(model_dir)
        if not self.speakers:
            raise StageEngineError(f"{SPEAKER_FILE} of {model_dir} holds no speaker")

    @property
    def voices(self) -> list[str]:
        return list(self.speakers)

    def prepare(self, request: StageRequest) -> tuple[torch.Tensor, AudioParams]:
        """``(codes int64 [1, N], AudioParams)`` of a validated request."""
        codes = request.prompt.tensor("codes", consumer=self.stage.label).reshape(1, -1).long()
        return codes, request.params or AudioParams()

    def run(self, work: tuple[torch.Tensor, AudioParams]) -> AudioOutput:
        return self.synthesize(*work)

    def validate_request(self, request: StageRequest) -> None:
        """Every check of :meth:`submit`, queueing nothing."""
        params = request.params or AudioParams()
        self.check_request(request, AudioParams, "talker", params.voice, self.voices)
        if params.num_steps < 2:
            raise InvalidRequestError(f"{self.stage.label}: num_steps must be at least 2")
        if request.prompt is None:
            raise InvalidRequestError(f"{self.stage.label} takes the talker's StagePayload, got NoneType")

    def synthesize(self, codes: torch.Tensor, params: AudioParams) -> AudioOutput:
        """One waveform from ``codes`` (int64 ``[1, N]``), on the calling thread; no codes (the talker's
        first sample was a stop code) give an empty waveform, as Qwen3-Omni's code2wav does (transformers'
        Token2Wav fails on them: its padded input is shorter than its first kernel)."""
        if codes.shape[-1] == 0:
            return AudioOutput(np.zeros(0, dtype=np.float32), SAMPLE_RATE, codes.reshape(-1).clone())
        speaker = self.speakers[params.voice or self.voices[0]]
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            wav = self.model(
                codes,
                conditioning=speaker["cond"].float().expand(1, -1),
                reference_mel=speaker["ref_mel"].float().expand(1, -1, -1),
                num_steps=params.num_steps,
                guidance_scale=params.guidance_scale,
                sway_coefficient=params.sway_coefficient,
            )
        waveform = wav.reshape(-1).float().numpy().astype(np.float32, copy=True)
        return AudioOutput(waveform, SAMPLE_RATE, codes.reshape(-1).clone())
