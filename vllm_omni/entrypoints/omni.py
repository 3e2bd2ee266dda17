"""``Omni``: the synchronous (offline) entry point."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.lora.request import LoRARequest
from vllm_omni.outputs import OmniRequestOutput


class Omni(OmniBase):
    """Run a pipeline offline: ``Omni(model, **options).generate(prompts, ...)``.

    One real engine per stage is started at construction (a vLLM ``LLMEngine`` for LLM
    stages). See :class:`~vllm_omni.entrypoints.omni_base.OmniBase` for the arguments.
    """

    def generate(
        self,
        prompts: Any,
        sampling_params: Any = None,
        *,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        **entry_kwargs: Any,
    ) -> list[OmniRequestOutput]:
        """Run prompts through every stage; requests run concurrently.

        Args:
            prompts: one prompt (str / token ids / vLLM prompt dict) or a list of them.
            sampling_params: see ``OmniBase._stage_params``.
            lora_request: one adapter for every prompt, or one per prompt (``None`` = base);
                attached to the entry stage's requests only.
            use_tqdm: show a progress bar over requests.

        Returns:
            The final-output stage results, prompt by prompt, stage order within a prompt.

        Raises:
            LoRANotEnabledError / InvalidAdapterError / StageEngineError: before any request
            starts when the adapter cannot be served; otherwise the first failure.
        """
        single = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        prompt_list = [prompts] if single else list(prompts)
        if isinstance(lora_request, list):
            if len(lora_request) != len(prompt_list):
                raise ValueError(
                    f"got {len(lora_request)} lora_request entries for {len(prompt_list)} prompts"
                )
            loras = lora_request
        else:
            loras = [lora_request] * len(prompt_list)
        params = self._stage_params(sampling_params)
        futures = [
            self._orchestrator.submit(p, params, lora_request=lr, **entry_kwargs)
            for p, lr in zip(prompt_list, loras)
        ]
        results: list[OmniRequestOutput] = []
        bar = tqdm(total=len(futures), desc="Requests", disable=not use_tqdm or len(futures) < 2)
        for fut in futures:
            results.extend(fut.result())
            bar.update(1)
        bar.close()
        return results

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter on every stage that has LoRA enabled (validated first)."""
        return self._add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Remove an adapter from every LoRA stage; True if any stage held it."""
        return self._remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters registered on any LoRA stage."""
        return self._list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Pin an adapter (never evicted) on every LoRA stage."""
        return self._pin_lora(lora_int_id)

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
