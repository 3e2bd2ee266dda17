"""Adapter names are one namespace with the served model's names (issue 13, item 11), at start-up.

``register_startup_adapters`` runs against a stand-in engine (it only needs ``add_lora``): every
way a start-up adapter gets a name (``--lora-path``, ``--lora-modules``) follows the registry's one
rule, and a clash stops the server with a ``ConfigError`` naming the flag, instead of one name
silently shadowing another.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tests.lora.fake_stages import FakeStages
from vllm_omni.entrypoints.openai.settings import ServerSettings
from vllm_omni.entrypoints.openai.state import make_state, register_startup_adapters
from vllm_omni.entrypoints.stage_info import EntryStageInfo
from vllm_omni.errors import ConfigError
from vllm_omni.lora.registry import AdapterRegistry
from vllm_omni.lora.request import LoRARequest, stable_lora_int_id

ADAPTERS = Path(__file__).resolve().parents[2] / "examples" / "demo_model" / "adapters"
WARM, STRIPES = str(ADAPTERS / "warm"), str(ADAPTERS / "stripes")


class _Engine:
    """What ``register_startup_adapters`` uses of ``AsyncOmni``: its entry-stage description and its
    adapter registry (over stand-in stages; the ``lora_path`` adapters adopted as ``Omni`` does)."""

    def __init__(self, lora_paths: tuple[str, ...]):
        adapters = tuple(LoRARequest(Path(p).name, stable_lora_int_id(p), p) for p in lora_paths)
        self.entry_stage_info = EntryStageInfo(
            pipeline="z_image",
            model="/models/demo",
            label="stage 0",
            is_llm=False,
            model_arch="ZImagePipeline",
            stage_is_llm=(False,),
            output_kinds=frozenset({"image"}),
            max_adapters_per_request=2,
            startup_lora_paths=lora_paths,
            startup_adapters=adapters,
        )
        self.stages = FakeStages(1)
        self.adapter_registry = AdapterRegistry(self.stages.call)
        for lora in adapters:
            self.adapter_registry.adopt(lora, 0)
        self.added: list[str] = []

    async def add_lora(self, lora: LoRARequest, **kwargs) -> bool:
        self.added.append(lora.lora_name)
        return self.adapter_registry.add(lora, **kwargs)


def _start(lora_paths=(), lora_modules=(), served=("demo",)):
    engine = _Engine(tuple(lora_paths))
    settings = ServerSettings(served_model_names=list(served), lora_modules=list(lora_modules))
    state = make_state(engine, settings)
    asyncio.run(register_startup_adapters(state))
    return state, engine


def test_distinct_names_are_all_registered():
    state, engine = _start([STRIPES], [("warm", WARM)], served=("demo", "demo-alias"))
    assert set(state.registry.named) == {"stripes", "warm"}
    assert engine.added == ["warm"]


@pytest.mark.parametrize(
    ("lora_paths", "lora_modules", "flag"),
    [
        ((), [("demo", WARM)], "--lora-modules demo="),  # a served model name
        ((), [("demo-alias", WARM)], "--lora-modules demo-alias="),
        ((), [("/models/demo", WARM)], "--lora-modules /models/demo="),  # the model itself
        ((), [("w", WARM), ("w", STRIPES)], "--lora-modules w="),  # two modules, one name
        ([STRIPES], [("stripes", WARM)], "--lora-modules stripes="),  # a --lora-path adapter's name
    ],
)
def test_a_clashing_startup_name_stops_the_server(lora_paths, lora_modules, flag):
    with pytest.raises(ConfigError, match="name") as info:
        _start(lora_paths, lora_modules, served=("demo", "demo-alias"))
    assert flag in str(info.value)


def test_a_lora_path_adapter_named_like_the_model_stops_the_server(tmp_path):
    clash = tmp_path / "demo"
    shutil.copytree(WARM, clash)
    with pytest.raises(ConfigError, match="--lora-path .*'demo'"):
        _start([str(clash)])
