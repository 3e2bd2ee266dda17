"""Argument checks of a LoRA activation (per-sample adapters and scales), before any work is done."""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest, lora_request_problem
from vllm_omni.lora.schedule import LoRAScaleSchedule


def check_request(request: object) -> tuple[int, str]:
    """``(lora_int_id, lora_path)`` of a request (:func:`~vllm_omni.lora.request.lora_request_problem`).

    Raises:
        InvalidRequestError: not a ``LoRARequest`` with a positive id and a path.
    """
    problem = lora_request_problem(request)
    if problem is not None:
        raise InvalidRequestError(f"an adapter {problem}")
    return request.lora_int_id, str(request.lora_path)


def validate_activation(
    requests_per_sample: Sequence, scales_per_sample: Sequence, max_loras: int
) -> tuple[list, list]:
    """Check one activation's arguments (see ``DiffusionLoRAManager.set_active_adapters``) before any work.

    Returns ``(requests, scales)`` as lists of lists (one per sample).

    Raises:
        InvalidRequestError: naming the sample and adapter at fault.
    """
    if isinstance(requests_per_sample, (str, bytes)) or not isinstance(requests_per_sample, Sequence):
        raise InvalidRequestError("requests_per_sample must be a list")
    if not isinstance(scales_per_sample, Sequence):
        raise InvalidRequestError("scales_per_sample must be a list")
    if len(requests_per_sample) != len(scales_per_sample):
        raise InvalidRequestError(
            f"got {len(requests_per_sample)} request entries but {len(scales_per_sample)} scale entries"
        )
    reqs: list[list[LoRARequest]] = []
    scales: list[list[float]] = []
    paths: dict[int, str] = {}
    for n, (sample_reqs, sample_scales) in enumerate(
        zip(requests_per_sample, scales_per_sample, strict=True)
    ):
        sample_reqs, sample_scales = list(sample_reqs), list(sample_scales)
        if len(sample_reqs) != len(sample_scales):
            raise InvalidRequestError(
                f"sample {n}: {len(sample_reqs)} adapters but {len(sample_scales)} scales"
            )
        if len(sample_reqs) > max_loras:
            raise InvalidRequestError(f"sample {n}: {len(sample_reqs)} adapters exceed max_loras={max_loras}")
        seen: set[int] = set()
        values: list[float] = []
        for request, scale in zip(sample_reqs, sample_scales, strict=True):
            lora_id, path = check_request(request)
            if lora_id in seen:
                raise InvalidRequestError(f"sample {n}: LoRA {lora_id} appears twice in one request")
            seen.add(lora_id)
            if paths.setdefault(lora_id, path) != path:
                raise InvalidRequestError(
                    f"LoRA id {lora_id} is used for two paths: {paths[lora_id]!r} and {path!r}"
                )
            if isinstance(scale, LoRAScaleSchedule):
                values.append(scale)
                continue
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise InvalidRequestError(
                    f"sample {n}: LoRA {lora_id} scale must be a finite number or a LoRAScaleSchedule, "
                    f"got {scale!r:.100}"
                )
            values.append(float(scale))
        reqs.append(sample_reqs)
        scales.append(values)
    if len(paths) > max_loras:
        raise InvalidRequestError(f"the batch uses {len(paths)} distinct adapters; max_loras={max_loras}")
    return reqs, scales
