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
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import Qwen2_5OmniConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

from vllm_omni.engine.connectors import StagePayload
from vllm_omni.engine.protocols import StageDescription
from vllm_omni.engine.stage_driver import StageDriver
from vllm_omni.errors import InvalidRequestError, LoRANotEnabledError, StageEngineError
from vllm_omni.inputs.audio import AudioParams
from vllm_omni.inputs.stage_request import StageRequest

logger = logging.getLogger(__name__)

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


@dataclass
class _Pending:
    codes: torch.Tensor
    params: AudioParams
    future: Future
    submitted: float = field(default_factory=time.monotonic)


class Code2WavStageEngine(StageDriver):
    """Runs the code2wav stage: ``submit(payload, AudioParams)`` -> future of :class:`AudioOutput`.

    The prompt is the talker's :class:`~vllm_omni.engine.connectors.StagePayload` whose
    ``"codes"`` tensor (int64 ``[N]``) holds the codec tokens before the talker's stop token.
    No LoRA: the LoRA management calls raise ``LoRANotEnabledError``.

    Raises:
        StageEngineError: no model directory, or the checkpoint cannot be loaded.
    """

    def __init__(self, stage: Any):
        self.stage = stage
        if not stage.model:
            raise StageEngineError(f"{stage.label}: no model directory given for the code2wav stage")
        try:
            self.model = load_token2wav(stage.model)
            self.speakers = load_speakers(stage.model)
        except StageEngineError as exc:
            raise StageEngineError(f"{stage.label}: {exc}") from exc
        except Exception as exc:  # a checkpoint transformers cannot read
            raise StageEngineError(f"{stage.label}: cannot load token2wav from {stage.model}: {exc}") from exc
        if not self.speakers:
            raise StageEngineError(f"{stage.label}: {SPEAKER_FILE} of {stage.model} holds no speaker")
        self._init_driver()
        self._thread = threading.Thread(target=self._drive, name=f"omni-stage-{stage.stage_id}", daemon=True)
        self._thread.start()

    @property
    def voices(self) -> list[str]:
        return list(self.speakers)

    def describe(self) -> StageDescription:
        """Audio out (:class:`AudioOutput`, ``SAMPLE_RATE`` Hz); the talker's payload in;
        ``AudioParams``; the checkpoint's voices; no LoRA."""
        return StageDescription(
            self.stage.stage_id,
            self.stage.label,
            "audio",
            frozenset({"stage_payload"}),
            AudioParams,
            voices=tuple(self.speakers),
        )

    def submit(self, request: StageRequest) -> Future:
        """Queue one waveform request (see the class docstring).

        Raises (synchronously): ``InvalidRequestError`` (unknown voice, bad params or codes),
        ``LoRANotEnabledError`` (an adapter), ``StageEngineError`` (shut down / dead).
        """
        self.validate_request(request)
        prompt, params = request.prompt, request.params
        codes = prompt.tensor("codes", consumer=self.stage.label).reshape(1, -1).long()
        item = _Pending(codes, params or AudioParams(), Future())
        with self._cv:
            self._raise_if_unusable()
            self._queue.append(item)
            self._cv.notify()
        return item.future

    def validate_request(self, request: StageRequest) -> None:
        """Every check of :meth:`submit`, queueing nothing."""
        prompt, params = request.prompt, request.params
        if request.adapters:
            raise LoRANotEnabledError(f"{self.stage.label} (code2wav) takes no adapter")
        if params is not None and not isinstance(params, AudioParams):
            raise InvalidRequestError(f"{self.stage.label} takes AudioParams, got {type(params).__name__}")
        voice = (params or AudioParams()).voice
        if voice is not None and voice not in self.speakers:
            raise InvalidRequestError(f"{self.stage.label}: unknown voice {voice!r}; voices: {self.voices}")
        if (params or AudioParams()).num_steps < 2:
            raise InvalidRequestError(f"{self.stage.label}: num_steps must be at least 2")
        if not isinstance(prompt, StagePayload):
            raise InvalidRequestError(
                f"{self.stage.label} takes the talker's StagePayload, got {type(prompt).__name__}"
            )

    def synthesize(self, codes: torch.Tensor, params: AudioParams) -> AudioOutput:
        """One waveform from ``codes`` (int64 ``[1, N]``), on the calling thread."""
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

    # LoRA management: code2wav has no adapters
    def _no_lora(self, *_: Any) -> Any:
        raise LoRANotEnabledError(f"{self.stage.label} (code2wav) does not support LoRA")

    add_lora = remove_lora = list_loras = pin_lora = _no_lora

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the driver (a running synthesis finishes first, up to ``timeout`` s, default 60)."""
        deadline = time.monotonic() + (60.0 if timeout is None else timeout)
        self._stop_driver(self._thread, deadline - time.monotonic())

    def _drive(self) -> None:
        while (work := self._next_work(self._queue.popleft)) is not None:
            commands, item = work
            self._run_commands(commands)
            if item is None or not item.future.set_running_or_notify_cancel():
                continue
            try:
                wav = self.synthesize(item.codes, item.params)
            except Exception as exc:
                logger.warning("%s: synthesis failed: %s", self.stage.label, exc)
                self.recorder.request_done((), time.monotonic() - item.submitted, False)
                item.future.set_exception(StageEngineError(f"{self.stage.label}: synthesis failed: {exc}"))
                continue
            self.recorder.request_done((), time.monotonic() - item.submitted, True)
            item.future.set_result(wav)
