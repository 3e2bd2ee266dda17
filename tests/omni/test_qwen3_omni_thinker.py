"""The Qwen3-Omni MoE thinker on vLLM with LoRA on CPU (tiny checkpoint, float32).

``Omni(<folder>)`` picks the pipeline from ``config.json``; on ``qwen3_omni_thinker_only``, greedy
tokens equal transformers' ``Qwen3OmniMoeForConditionalGeneration`` thinker with and without a
thinker adapter (peft);
``enable_lora`` runs on CPU because the MoE experts stay out of LoRA
(:func:`vllm_omni.models.moe_lora.keep_moe_experts_out_of_lora`), and an adapter on expert weights is
refused before it reaches vLLM, which would load it and silently not apply it."""

from __future__ import annotations

import json

import pytest
from omni_reference import thinker_greedy

from tests.conftest import test_assets_root
from vllm_omni.errors import InvalidAdapterError
from vllm_omni.lora.request import LoRARequest

PROMPTS = ["Once upon a time", "The weather today is"]
N = 8
THINKER_ARCH = "OmniQwen3OmniMoeThinkerForConditionalGeneration"


@pytest.fixture(scope="module")
def assets():
    from tools.make_tiny_qwen3_omni import ensure_tiny_qwen3_omni_assets

    return ensure_tiny_qwen3_omni_assets(test_assets_root())


@pytest.fixture(scope="module")
def omni(assets):
    from vllm_omni import Omni

    # peft writes rank_pattern {".*\\.gate_up_proj": 2r} into every adapter of this model, and
    # vLLM checks that rank against max_lora_rank: 16 for the rank-8 adapters here
    stage = {"dtype": "float32", "enable_lora": True, "max_lora_rank": 16, "max_model_len": 256}
    with Omni(
        str(assets.model_dir), pipeline="qwen3_omni_thinker_only", stage_overrides={"0": stage}
    ) as engine:
        yield engine


def _params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def _prompt_ids(omni, text):
    return omni._orchestrator.runtimes[0].tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("arch", "audio", "expected"),
    [
        ("Qwen3OmniMoeForConditionalGeneration", None, "qwen3_omni"),
        ("Qwen3OmniMoeForConditionalGeneration", False, "qwen3_omni_thinker_only"),
        ("Qwen2_5OmniForConditionalGeneration", None, "qwen2_5_omni"),
        ("Qwen2_5OmniForConditionalGeneration", False, "qwen2_5_omni_thinker_only"),
    ],
)
def test_pipeline_is_picked_from_config_json(tmp_path, arch, audio, expected):
    from vllm_omni.config.pipeline_registry import pipeline_for_model, resolve_pipeline_config

    cfg = {"architectures": [arch]} | ({} if audio is None else {"enable_audio_output": audio})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert pipeline_for_model(str(tmp_path)) == resolve_pipeline_config(expected)


def test_thinker_runs_vllms_moe_thinker_with_experts_out_of_lora(omni):
    """Without torchvision (this venv) the stage is made text-only, as Qwen2.5-Omni's thinker."""
    from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration

    from vllm_omni.models import qwen3_omni_thinker
    from vllm_omni.models.moe_lora import moe_experts_kept_out_of_lora

    assert omni.config.pipeline.name == "qwen3_omni_thinker_only"
    assert omni.stage_configs[0].model_arch == THINKER_ARCH
    assert qwen3_omni_thinker.Qwen3OmniMoeThinkerForConditionalGeneration is (
        Qwen3OmniMoeThinkerForConditionalGeneration
    )
    assert moe_experts_kept_out_of_lora()
    mm = omni._orchestrator.runtimes[0]._engine.vllm_config.model_config.multimodal_config
    assert [mm.get_limit_per_prompt(m) for m in ("audio", "image", "video")] == [0, 0, 0]


def test_thinker_tokens_equal_transformers_with_and_without_adapter(omni, assets):
    adapter = LoRARequest("thinker", 1, str(assets.thinker_adapter))
    base = omni.generate(PROMPTS, _params(), use_tqdm=False)
    adapted = omni.generate(PROMPTS, _params(), lora_request=adapter, use_tqdm=False)
    for prompt, plain, out in zip(PROMPTS, base, adapted):
        ids = _prompt_ids(omni, prompt)
        assert plain.token_ids == thinker_greedy(assets.model_dir, ids, N)
        assert out.token_ids == thinker_greedy(assets.model_dir, ids, N, assets.thinker_adapter)
        assert out.token_ids != plain.token_ids  # the adapter does change the output


def _per_expert_adapter(path, layer0_experts=2):
    """An adapter in the per-expert layout (``mlp.experts.{e}.gate_proj``, as vLLM's 2-D MoE LoRA
    reads it) on the thinker's layer-0 experts, plus a valid ``q_proj``."""
    import torch
    from safetensors.torch import save_file

    from tools.make_tiny_qwen3_omni import HIDDEN

    prefix = "base_model.model.thinker.model.layers.0."
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN)}
    shapes |= {f"mlp.experts.{e}.gate_proj": (HIDDEN, 64) for e in range(layer0_experts)}
    tensors = {}
    for module, (d_in, d_out) in shapes.items():
        tensors[f"{prefix}{module}.lora_A.weight"] = torch.full((8, d_in), 0.01)
        tensors[f"{prefix}{module}.lora_B.weight"] = torch.full((d_out, 8), 0.01)
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "gate_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("layout", ["peft", "per_expert"])
def test_adapter_on_moe_experts_is_refused_with_the_reason(omni, assets, tmp_path, layout):
    """peft 0.21 turns the MLP names into the fused experts of every MoE block (target_parameters);
    an adapter in the per-expert layout names them as modules. vLLM on CPU keeps experts out of
    LoRA and would serve the base model for them: both are refused, saying why, and the stage
    keeps serving."""
    path = assets.experts_adapter if layout == "peft" else _per_expert_adapter(tmp_path / "experts")
    with pytest.raises(InvalidAdapterError) as err:
        omni.generate(
            PROMPTS[0],
            _params(),
            lora_request=LoRARequest("experts", 2 if layout == "peft" else 3, str(path)),
            use_tqdm=False,
        )
    message = str(err.value)
    assert "'experts'" in message
    assert "keeps MoE experts out of LoRA" in message and "Triton" in message
    if layout == "per_expert":
        assert "Stage 0 (llm_ar)" in message
        assert "thinker.model.layers.0.mlp.experts.0.gate_proj" in message
    else:
        assert "target_parameters" in message
    (out,) = omni.generate(PROMPTS[0], _params(), use_tqdm=False)
    assert out.token_ids == thinker_greedy(assets.model_dir, _prompt_ids(omni, PROMPTS[0]), N)


def test_serve_picks_the_pipeline_from_config_json(assets, monkeypatch, capsys):
    """``vllm-omni serve <folder>`` resolves what ``Omni(<folder>)`` does (``--dry-run``: nothing starts)."""
    from vllm_omni.entrypoints.cli import main as cli_main

    def no_server(*_a, **_k):
        raise AssertionError("the server was started")

    monkeypatch.setattr("vllm_omni.entrypoints.openai.api_server.run_server", no_server)
    cli_main.main(["serve", str(assets.model_dir), "--dry-run"])
    described = json.loads(capsys.readouterr().out)
    assert described["pipeline"] == "qwen3_omni"
    assert [s["model_arch"] for s in described["stages"]] == [
        THINKER_ARCH,
        "OmniQwen3OmniMoeTalkerForConditionalGeneration",
        "OmniQwen3OmniMoeCode2Wav",
    ]
