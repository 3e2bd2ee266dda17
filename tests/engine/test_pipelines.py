"""Multi-stage LLM pipelines on real vLLM engines: stage chaining and where a request's adapter goes."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.llm_reference import hf_greedy
from vllm_omni.errors import LoRANotEnabledError, StageEngineError
from vllm_omni.lora.request import LoRARequest

pytestmark = pytest.mark.engine

N = 8


def test_llm_chain_stage1_consumes_stage0_text_and_adapter_reaches_entry_only(tiny_llm_assets, tmp_path):
    from vllm_omni import Omni

    model = str(tiny_llm_assets.model_dir)
    deploy = tmp_path / "chain.yaml"
    deploy.write_text(
        f"pipeline: llm_chain\n"
        f"stages:\n"
        f"  - stage_id: 0\n    model: {model}\n    enable_lora: true\n    max_lora_rank: 16\n"
        f"    engine_extras: {{max_model_len: 256, dtype: float32}}\n"
        f"  - stage_id: 1\n    model: {model}\n    max_model_len: 256\n    dtype: float32\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    adapter = LoRARequest("a", 1, str(tiny_llm_assets.adapter_a))
    with Omni(deploy_config=str(deploy)) as omni:
        assert [s.lora_config is not None for s in omni.stage_configs] == [True, False]
        (out,) = omni.generate("hello world", [params, params], lora_request=adapter)
        stage0 = out.stage_outputs[0]
        assert out.stage_id == 1
        assert list(stage0.outputs[0].token_ids) == hf_greedy(
            model, "hello world", N, tiny_llm_assets.adapter_a
        )
        # stage 1's prompt is stage 0's text, and it ran without the adapter
        assert out.prompt == stage0.outputs[0].text
        assert out.token_ids == hf_greedy(model, out.prompt, N)
        # the stage 1 engine has no LoRA: runtime management skips it
        assert omni.list_loras() == {1}
        # per-stage request adapters: a stage without LoRA is refused before anything runs,
        # naming the stage and the option
        with pytest.raises(
            LoRANotEnabledError, match=r"Stage 1 \(llm_ar\) does not have LoRA enabled.*enable_lora"
        ):
            omni.generate("hello world", [params, params], lora_request={0: adapter, 1: adapter})
        # a registration one target stage refuses leaves nothing on the others (issue 21, rule 2)
        both = LoRARequest("both", 5, str(tiny_llm_assets.adapter_b))
        with pytest.raises(LoRANotEnabledError, match=r"adapter 'both' .*Stage 1 \(llm_ar\)"):
            omni.add_lora(both, stage_id=[0, 1])
        assert omni.list_loras(stage_id=0) == {1} and omni.adapter_registry.get("both") is None
        assert omni.add_lora(both) and omni.adapter_registry.get("both").targets == (
            0,
        )  # default: entry stage


def test_stage_with_unavailable_model_class_fails_at_engine_start(tiny_llm_assets):
    from vllm_omni import Omni

    with pytest.raises(
        StageEngineError,
        match=r"Stage 0 \(llm_ar\): model class 'Qwen3TTSTalkerForConditionalGeneration' is not available",
    ):
        Omni(str(tiny_llm_assets.model_dir), pipeline="qwen3_tts", max_model_len=64)


@pytest.mark.parametrize(
    ("name", "label", "missing"),
    [
        ("qwen3_tts", r"Stage 0 \(llm_ar\)", "Qwen3TTSTalkerForConditionalGeneration"),
        # qwen2_5_omni runs end to end (tests/omni/test_qwen2_5_omni_audio.py)
        ("bagel", r"Stage 0 \(llm_ar\)", "OmniBagelForConditionalGeneration"),
    ],
)
def test_registered_pipelines_without_models_fail_before_any_engine(
    tiny_llm_assets, monkeypatch, name, label, missing
):
    from vllm_omni import Omni
    from vllm_omni.engine import orchestrator

    def no_engine(stage):
        raise AssertionError(f"{stage.label} was started")

    monkeypatch.setattr(orchestrator, "make_stage_runtime", no_engine)
    with pytest.raises(StageEngineError, match=rf"{label}: model class '{missing}' is not available"):
        Omni(str(tiny_llm_assets.model_dir), pipeline=name)


def test_missing_class_of_a_later_stage_fails_before_the_first_engine(tiny_llm_assets, monkeypatch):
    from vllm_omni.config import VllmOmniConfig
    from vllm_omni.config.pipeline_registry import PipelineConfig, StageSpec
    from vllm_omni.engine import orchestrator

    started = []
    monkeypatch.setattr(orchestrator, "make_stage_runtime", started.append)
    for spec, message in [
        (
            StageSpec("diffusion", "BagelPipeline", (0,), final_output=True),
            r"unknown pipeline class 'BagelPipeline'",
        ),
        (
            StageSpec("llm_generation", "Qwen3TTSCode2Wav", (0,), final_output=True),
            r"model class 'Qwen3TTSCode2Wav'",
        ),
    ]:
        pipeline = PipelineConfig("half_available", (StageSpec("llm_ar", "Qwen2ForCausalLM"), spec))
        config = VllmOmniConfig.from_pipeline_config(pipeline, model=str(tiny_llm_assets.model_dir))
        with pytest.raises(StageEngineError, match=rf"Stage 1 \({spec.stage_type}\): {message}"):
            orchestrator.Orchestrator(config)
    assert started == []
