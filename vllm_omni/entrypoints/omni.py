"""``Omni``: the synchronous (offline) entry point."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from typing import Any

from tqdm.auto import tqdm

from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.entrypoints.request_adapters import without_params_loras
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import NO_ADAPTERS, LoRARequest, RequestAdapter, RequestAdapters
from vllm_omni.outputs import OmniRequestOutput


class Omni(OmniBase):
    """Run a pipeline offline: ``Omni(model, **options).generate(prompts, ...)``.

    One real engine per stage is started at construction (a vLLM ``LLMEngine`` for LLM
    stages). See :class:`~vllm_omni.entrypoints.omni_base.OmniBase` for the arguments.
    """

    def generate(
        self,
        prompts: Any = None,
        sampling_params: Any = None,
        *,
        prompt: Any = None,
        lora_request: LoRARequest | dict[int, LoRARequest] | list | None = None,
        lora_scale: float | None = None,
        lora_requests: list[LoRARequest] | list[list[LoRARequest]] | None = None,
        lora_scales: list[float] | list[list[float]] | None = None,
        adapters: Sequence[RequestAdapter] | None = None,
        use_tqdm: bool = True,
        last_stage: int | None = None,
    ) -> list[OmniRequestOutput]:
        """Run prompts through every stage; requests run concurrently.

        Args:
            prompts: one prompt (str / token ids / vLLM prompt dict) or a list of them;
                ``prompt=`` is an alias. Prompts for a diffusion entry stage are submitted
                together, so compatible ones share denoiser batches.
            last_stage: each request ends after this stage (its later stages do not run; e.g.
                text only from ``qwen2_5_omni`` with ``last_stage=0``); ``None``: every stage.
            sampling_params: see ``OmniBase._stage_params`` (``OmniDiffusionSamplingParams``
                for diffusion stages, which may carry ``lora_requests`` / ``lora_scales``).
            lora_request: one adapter for every prompt, or one per prompt (``None`` = base);
                attached to the entry stage's requests only. Per-stage request adapters (opt-in
                extension): a dict ``{stage_id: LoRARequest}`` (for every prompt, or as a
                per-prompt entry) gives each named stage its own adapter; every named stage
                must be an LLM stage with LoRA enabled, else the request is refused before it
                starts.
            lora_scale: scale of ``lora_request`` (diffusion entry stages; default 1.0).
            lora_requests / lora_scales: adapters composed in one request (diffusion entry
                stages): a list of ``LoRARequest`` for every prompt, or one list per prompt;
                scales default to 1.0 each.
            adapters: the same adapters for every prompt as
                :class:`~vllm_omni.lora.request.RequestAdapter` (``scale=None``: the stage
                default; ``stage_id`` set: a later LLM stage's adapter), instead of the
                ``lora_*`` arguments.
            use_tqdm: show a progress bar over requests.

        Returns:
            The final-output stage results, prompt by prompt, stage order within a prompt;
            diffusion stages fill ``images`` (PIL) and ``latents``.

        Raises:
            InvalidRequestError (a ValueError): prompts given twice or not at all, mismatched
                per-prompt lists, diffusion LoRA arguments on an LLM entry stage, or (diffusion)
                an invalid request;
            LoRANotEnabledError / InvalidAdapterError / StageEngineError: before any request
                starts when an adapter cannot be served by its stage (the message names the
                stage); otherwise the first failure.
        """
        prompt_list = _prompt_list(prompts, prompt)
        self._orchestrator.check_open()
        # made ready once (e.g. an LLM stage's one-final-output clone), not per request
        params = self._orchestrator.prepare_params(self._stage_params(sampling_params))
        forms = dict(lora_request=lora_request, lora_scale=lora_scale, lora_requests=lora_requests)
        forms.update(lora_scales=lora_scales, adapters=adapters)
        per_prompt = self._request_adapters(len(prompt_list), params, **forms)
        params = [without_params_loras(p) for p in params]  # their adapters are in per_prompt now
        requests = [(p, self._versioned(a)) for p, a in zip(prompt_list, per_prompt, strict=True)]
        futures = self._submit_all(requests, params, last_stage)
        _wait_all(futures, use_tqdm)
        results: list[OmniRequestOutput] = []
        for fut in futures:  # prompt order; raises the first failure in that order
            results.extend(fut.result())
        return results

    def _submit_all(
        self,
        requests: list[tuple[Any, dict[int, RequestAdapters]]],
        params: list[Any],
        last_stage: int | None,
    ) -> list[Future]:
        """Check every request at its entry stage, then submit them all in one batching block
        (compatible diffusion requests share denoiser batches); one future per request, in order.

        Args:
            requests: per prompt, (prompt, its adapters per stage, checked and versioned).

        Raises:
            the errors of the entry stage's ``validate_request``, before any request is submitted.
        """
        entry = self._orchestrator.runtimes[0]
        entry_id = self.config.entry_stage.stage_id
        for prompt, adapters in requests:
            entry.validate_request(StageRequest(prompt, params[0], adapters.get(entry_id, NO_ADAPTERS)))
            self._check_multimodal_reach(prompt, last_stage)
        with self._orchestrator.batching():
            return [
                self._orchestrator.submit(prompt, params, adapters, last_stage=last_stage)
                for prompt, adapters in requests
            ]

    def add_lora(
        self,
        lora_request: LoRARequest,
        stage_id: int | list[int] | None = None,
        *,
        reload: bool = False,
        denoiser: str | None = None,
        replace: bool = True,
    ) -> bool:
        """Register an adapter in the engine's adapter registry and load it on the stages it targets
        (validated first; all-or-nothing over those stages and their replicas).

        Args:
            lora_request: ``LoRARequest(name, int_id, path)``; ``path`` is a PEFT folder (LLM stages) or
                a PEFT folder / ``.safetensors`` file (diffusion stages).
            stage_id: the target stage(s); default: where ``name`` is registered already, else the entry
                stage (an adapter fits one model). LLM stages need ``enable_lora``.
            reload: re-read the files even if their size and mtime did not change.
            denoiser: the denoiser it targets on a two-denoiser diffusion stage.
            replace: ``False`` refuses a name that is registered already (``InvalidAdapterError``).

        Returns:
            ``True`` if the registry changed (a new adapter, a new version of its content, a new target);
            ``False`` for the same name, id and content registered there already (a stage that evicted
            it loads it again).
            The same name with other content (new files at the same path, another path) is a new version:
            no stage serves the old weights afterwards (see ``docs/user_guide/adapter_registry.md``).

        Raises:
            InvalidAdapterError (a ValueError): a stage refuses it (nothing stays loaded on any stage),
                or its id names another adapter; AdapterNotFoundError (also a FileNotFoundError): no such path;
            LoRANotEnabledError: a target stage without LoRA.
        """
        return self._add_lora(lora_request, stage_id, reload, denoiser, replace)

    def remove_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        """Remove an adapter (every version of it) from every stage, or from ``stage_id``; True if a stage held it.

        On a diffusion stage this waits for a running batch that uses the adapter.
        """
        return self._remove_lora(lora_int_id, stage_id)

    def list_loras(self, stage_id: int | None = None) -> set[int]:
        """Ids of the adapters loaded on any LoRA stage (or on ``stage_id``), as the caller gave them."""
        return self._list_loras(stage_id)

    def pin_lora(self, lora_int_id: int, stage_id: int | None = None) -> bool:
        """Pin an adapter (never evicted) on the stages it is registered on (or on ``stage_id``)."""
        return self._pin_lora(lora_int_id, stage_id)

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _prompt_list(prompts: Any, prompt: Any) -> list[Any]:
    """``generate``'s prompts as a list (``prompt=`` is an alias of ``prompts``).

    Raises:
        InvalidRequestError: both or neither given, or not a prompt / list of prompts.
    """
    if prompts is not None and prompt is not None:
        raise InvalidRequestError(
            "pass the prompts either positionally / as prompts= or as prompt=, not both"
        )
    prompts = prompt if prompts is None else prompts
    if prompts is None:
        raise InvalidRequestError("generate() needs a prompt (prompts=... or prompt=...)")
    single = isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    )
    if not single and not isinstance(prompts, list | tuple):
        raise InvalidRequestError(
            "prompts must be a string, a list of token ids, a prompt dict or a list of those, "
            f"got {type(prompts).__name__}"
        )
    return [prompts] if single else list(prompts)


def _wait_all(futures: list[Future], use_tqdm: bool) -> None:
    """Wait until every request is done or one failed, without waking per request: every
    wake-up takes the GIL from the stage's driver thread while it resolves the other requests
    finished by the same step."""
    if not use_tqdm or len(futures) < 2:
        wait(futures, return_when=FIRST_EXCEPTION)  # one wake-up
        return
    with tqdm(total=len(futures), desc="Requests") as bar:
        pending = futures
        while pending:  # one wake-up per group of requests that finish together
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            bar.update(len(done))
            if any(fut.exception() is not None for fut in done):
                break
