"""Qwen3-Omni's talker stage alone (no vLLM engine): what its LoRA options and adapters require.

The codes with an adapter are compared with transformers + peft in ``test_qwen3_omni_pipeline.py``
(one pipeline serves those tests); here, the stage's own refusals before anything runs.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.conftest import test_assets_root
from vllm_omni.errors import LoRANotEnabledError, StageEngineError
from vllm_omni.inputs.stage_request import StageRequest
from vllm_omni.lora.request import LoRARequest, RequestAdapters

TALKER_ARCH = "OmniQwen3OmniMoeTalkerForConditionalGeneration"


@pytest.fixture(scope="module")
def assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


def _talker(assets, **options):
    from vllm_omni.config.stage_config import make_stage_config
    from vllm_omni.stages.qwen3_omni.talker import TalkerStageEngine

    stage = make_stage_config(
        stage_id=1, stage_type="llm_ar", model=str(assets.model_dir), model_arch=TALKER_ARCH, options=options
    )
    return TalkerStageEngine(stage)


def test_talker_without_enable_lora_refuses_adapters_naming_the_option(assets):
    talker = _talker(assets)
    try:
        assert talker.describe().adapters is None
        lora = LoRARequest("talker", 1, str(assets.talker_adapter))
        request = StageRequest(None, SamplingParams(), RequestAdapters.of(lora))
        match = r"Stage 1 \(llm_ar\) \(talker\) does not have LoRA enabled; set enable_lora=True"
        with pytest.raises(LoRANotEnabledError, match=match):
            talker.validate_request(request)
        with pytest.raises(LoRANotEnabledError, match=match):
            talker.add_lora(lora)
    finally:
        talker.shutdown()


def test_lora_options_the_talker_does_not_apply_are_refused_at_start(assets):
    """vLLM-only LoRA options (sharding, dtype, multimodal defaults ...) would be silently ignored."""
    with pytest.raises(StageEngineError, match=r"Stage 1 \(llm_ar\): .*remove \['fully_sharded_loras'\]"):
        _talker(assets, enable_lora=True, fully_sharded_loras=True)


def test_lora_target_modules_limit_the_talker_layers_an_adapter_may_name(assets, tmp_path):
    """With ``lora_target_modules=["q_proj", "v_proj"]`` only those layers get LoRA layers: the talker
    adapter (all projections) is refused naming the layers outside them; its q/v part passes."""
    import json

    from safetensors.torch import load_file, save_file

    from vllm_omni.errors import LoRAFormatError

    talker = _talker(assets, enable_lora=True, lora_target_modules=["q_proj", "v_proj"])
    try:
        assert all(name.endswith(("q_proj", "v_proj")) for name in talker.lora.manager.wrappers)
        full = LoRARequest("talker", 1, str(assets.talker_adapter))
        with pytest.raises(
            LoRAFormatError, match=r"'talker'.*'model.layers.0.self_attn.k_proj'.*lora_target_modules"
        ):
            talker.add_lora(full)
        tensors = load_file(assets.talker_adapter / "adapter_model.safetensors")
        save_file(
            {k: v for k, v in tensors.items() if ".q_proj." in k or ".v_proj." in k},
            tmp_path / "adapter_model.safetensors",
        )
        config = json.loads((assets.talker_adapter / "adapter_config.json").read_text())
        (tmp_path / "adapter_config.json").write_text(
            json.dumps(config | {"target_modules": ["q_proj", "v_proj"]})
        )
        assert talker.add_lora(LoRARequest("qv", 2, str(tmp_path))) and talker.list_loras() == {2}
    finally:
        talker.shutdown()
