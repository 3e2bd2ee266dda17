"""Issue 21 rule 3: on a two-denoiser stage (the tiny Wan2.2-style MoE: ``transformer`` high noise,
``transformer_2`` low noise) an adapter's target is explicit and means the same in every backend.

The rule (``vllm_omni.lora.request.assign_denoisers``): ``denoiser`` names the target (aliases
``high_noise`` / ``low_noise``); adapters that name none mean ``[high_noise, low_noise]`` by position,
as ``lora_path=[high, low]`` does in the distill backend (``tests/diffusion/test_wan_moe_distill.py``)
and as diffusers' ``load_lora_weights`` / ``load_into_transformer_2=True`` do; anything ambiguous is
refused with a message saying how to name the target, and nothing cached changes.

Values: final latents (fp32) against diffusers' ``WanPipeline`` with peft on the same weights, through
``Omni`` inline and with the ``mp`` and ``ray`` worker backends; frames over HTTP (``vllm-omni serve``, httpx: the
video route is not part of the openai client) against diffusers' frames.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import test_assets_root
from tests.diffusion.test_wan_moe_distill import GEN, NUM_FRAMES, PROMPT, SEED, _write_adapter
from tests.entrypoints.server_utils import HTTP
from vllm_omni.errors import InvalidRequestError
from vllm_omni.lora.request import LoRARequest, RequestAdapter, assign_denoisers

pytestmark = [pytest.mark.slow]
TOL = 1e-4


@pytest.fixture(scope="module")
def wan_moe_dir() -> Path:
    from tools.make_tiny_wan import ensure_tiny_wan

    return ensure_tiny_wan(test_assets_root(), moe=True)


@pytest.fixture(scope="module")
def loras(wan_moe_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("wan_moe_targets")
    high = _write_adapter(wan_moe_dir, "transformer", 10, root / "high")
    low = _write_adapter(wan_moe_dir, "transformer_2", 11, root / "low")
    extra = _write_adapter(wan_moe_dir, "transformer", 12, root / "extra")
    return {
        "root": root,
        "high": LoRARequest("high", 1, os.fspath(high)),
        "low": LoRARequest("low", 2, os.fspath(low)),
        "extra": LoRARequest("extra", 3, os.fspath(extra)),
    }


def _diffusers(
    model_dir: Path,
    on_1: list[str],
    on_2: list[str],
    output_type: str = "latent",
    weights: list[float] | None = None,
    **call,
):
    """diffusers' WanPipeline with the files in ``on_1`` loaded into ``transformer`` and those in
    ``on_2`` into ``transformer_2`` (``load_into_transformer_2=True``), adapter ``weights`` (default 1.0)
    and extra call arguments ``call``."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    names = []
    for i, path in enumerate(on_1):
        pipe.load_lora_weights(path, adapter_name=f"t1_{i}")
        names.append(f"t1_{i}")
    for i, path in enumerate(on_2):
        pipe.load_lora_weights(path, adapter_name=f"t2_{i}", load_into_transformer_2=True)
        names.append(f"t2_{i}")
    if names:
        pipe.set_adapters(names, weights or [1.0] * len(names))
    out = pipe(
        prompt=[PROMPT],
        num_frames=NUM_FRAMES,
        output_type=output_type,
        generator=[torch.Generator().manual_seed(SEED)],
        **GEN,
        **call,
    )
    if output_type == "latent":
        return out.frames.float()
    return np.stack([np.asarray(f.convert("RGB"), dtype=np.int16) for f in out.frames[0]])


@pytest.fixture(scope="module")
def reference(wan_moe_dir, loras) -> dict[str, torch.Tensor]:
    high, low = loras["high"].lora_path, loras["low"].lora_path
    return {
        "base": _diffusers(wan_moe_dir, [], []),
        "pair": _diffusers(wan_moe_dir, [high], [low]),
        "both_high": _diffusers(wan_moe_dir, [high], [high]),
    }


def _sp(**extra):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(
        seed=SEED, output_type="latent", extra_args={"num_frames": NUM_FRAMES, **extra}, **GEN
    )


def _latents(omni, sp=None, **adapters) -> torch.Tensor:
    [out] = omni.generate([PROMPT], sp or _sp(), use_tqdm=False, **adapters)
    return torch.as_tensor(out.latents).float()


@pytest.fixture(scope="module")
def omni(wan_moe_dir):
    from vllm_omni import Omni

    # max_loras 3: a request of three adapters reaches the denoiser rule (2 would refuse it first)
    with Omni(str(wan_moe_dir), max_loras=3, dtype="float32") as engine:
        yield engine


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_pair_by_position_is_high_then_low_like_diffusers_and_distill(omni, loras, reference):
    """``lora_requests=[High, Low]`` (no denoiser named): High on ``transformer``, Low on
    ``transformer_2``, as ``load_into_transformer_2`` and the distill backend place them. Before this
    rule both landed on ``transformer``."""
    got = _latents(omni, lora_requests=[loras["high"], loras["low"]])
    assert _err(reference["pair"], reference["base"]) > 0.05
    assert _err(got, reference["pair"]) <= TOL
    both_on_1 = _diffusers(omni.config.model, [loras["high"].lora_path, loras["low"].lora_path], [])
    assert _err(got, both_on_1) > 1e-2  # the old, silent placement gives another result


def test_named_denoisers_in_any_order_and_one_adapter_on_both(omni, loras, reference):
    named = [
        RequestAdapter(loras["low"], denoiser="low_noise"),
        RequestAdapter(loras["high"], denoiser="transformer"),
    ]
    assert _err(_latents(omni, adapters=named), reference["pair"]) <= TOL
    twice = [
        RequestAdapter(loras["high"], denoiser="high_noise"),
        RequestAdapter(loras["high"], denoiser="transformer_2"),
    ]
    assert _err(_latents(omni, adapters=twice), reference["both_high"]) <= TOL


@pytest.mark.parametrize(
    ("adapters", "match"),
    [
        # three adapters, no denoiser named: the position rule covers two
        (
            lambda L: [RequestAdapter(L["high"]), RequestAdapter(L["low"]), RequestAdapter(L["extra"])],
            "2 adapters",
        ),
        # one named, one not: which denoiser the unnamed one means is ambiguous
        (lambda L: [RequestAdapter(L["high"], denoiser="low_noise"), RequestAdapter(L["low"])], "ambiguous"),
    ],
)
def test_ambiguous_targets_are_refused_and_change_nothing(omni, loras, adapters, match):
    before = omni.list_loras()
    with pytest.raises(InvalidRequestError) as info:
        omni.generate([PROMPT], _sp(), adapters=adapters(loras), use_tqdm=False)
    message = str(info.value)
    assert 'denoiser="transformer"' in message and "high_noise" in message and "low_noise" in message
    if match == "2 adapters":
        assert "LoRA 3, 'extra'" in message and "['transformer', 'transformer_2']" in message
    else:
        assert "LoRA 2, 'low'" in message and "ambiguous" in message
    assert omni.list_loras() == before


def test_unknown_denoiser_is_refused_naming_the_adapter(omni, loras):
    with pytest.raises(InvalidRequestError, match=r"LoRA 1, 'high'.*unknown denoiser 'middle'"):
        omni.generate([PROMPT], _sp(), adapters=[RequestAdapter(loras["high"], denoiser="middle")])


def test_denoiser_given_at_registration_places_the_adapter(omni, loras, reference):
    """``add_lora(..., denoiser=...)``: a request that names no denoiser puts each adapter where it was
    registered for, whatever its position (here Low first), equal to diffusers'
    ``load_into_transformer_2`` placement; an unknown denoiser is refused at ``add_lora`` and
    registers nothing."""
    from vllm_omni.errors import InvalidAdapterError

    before = omni.list_loras()
    with pytest.raises(InvalidAdapterError, match=r"'extra'.*unknown denoiser 'middle'"):
        omni.add_lora(loras["extra"], denoiser="middle")
    assert omni.list_loras() == before
    try:
        assert omni.add_lora(loras["low"], denoiser="low_noise")
        assert omni.add_lora(loras["high"], denoiser="transformer")
        got = _latents(omni, lora_requests=[loras["low"], loras["high"]])
        assert _err(got, reference["pair"]) <= TOL
    finally:
        omni.remove_lora(loras["low"].lora_int_id)
        omni.remove_lora(loras["high"].lora_int_id)
    # unregistered again: the position rule applies ([Low, High] = Low on the high-noise expert)
    assert _err(_latents(omni, lora_requests=[loras["low"], loras["high"]]), reference["pair"]) > 1e-2


def test_attention_kwargs_scale_acts_as_in_diffusers(omni, wan_moe_dir, loras, reference):
    """Issue 21 rule 6: ``attention_kwargs={"scale": s}`` in ``extra_args`` (where diffusers users give
    the LoRA scale of a Wan call) multiplies every adapter's scale, as diffusers' ``scale_lora_layers``
    does; the request's own scales still apply. Before, the fallback passed it to diffusers, whose
    ``scale_lora_layers`` finds no peft layer here, so the control was dropped silently."""
    high, low = loras["high"], loras["low"]
    want = _diffusers(
        wan_moe_dir, [high.lora_path], [low.lora_path], weights=[1.0, 0.6], attention_kwargs={"scale": 0.5}
    )
    got = _latents(
        omni, _sp(attention_kwargs={"scale": 0.5}), lora_requests=[high, low], lora_scales=[1.0, 0.6]
    )
    assert _err(got, want) <= TOL
    assert _err(want, reference["pair"]) > 1e-2  # the control matters
    # without adapters diffusers' scale changes nothing, and neither does ours
    assert _err(_latents(omni, _sp(attention_kwargs={"scale": 0.5})), reference["base"]) <= TOL
    with pytest.raises(
        InvalidRequestError, match=r"extra_args\['attention_kwargs'\]\['scale'\].*finite number"
    ):
        _latents(omni, _sp(attention_kwargs={"scale": "half"}), lora_requests=[high])


def test_add_and_remove_act_on_both_denoisers_all_or_nothing(omni, loras, tmp_path):
    """``add_lora`` on a two-denoiser stage loads the adapter for both denoisers; a file that fits
    neither leaves nothing behind; ``remove_lora`` drops it from both."""
    from safetensors.torch import load_file, save_file

    from vllm_omni.errors import LoRAFormatError

    before = omni.list_loras()
    assert omni.add_lora(loras["extra"]) and omni.list_loras() == before | {3}
    tensors = {
        k.replace("blocks.", "single_blocks."): v for k, v in load_file(loras["extra"].lora_path).items()
    }
    bad = tmp_path / "foreign.safetensors"
    save_file(tensors, str(bad))
    with pytest.raises(LoRAFormatError, match="foreign.safetensors"):
        omni.add_lora(LoRARequest("foreign", 9, str(bad)))
    assert omni.list_loras() == before | {3}
    assert omni.remove_lora(3) and omni.list_loras() == before


def test_peft_lora_path_longer_than_the_denoisers_is_a_config_error(wan_moe_dir, loras):
    from vllm_omni import Omni
    from vllm_omni.errors import ConfigError

    paths = [loras[k].lora_path for k in ("high", "low", "extra")]
    with pytest.raises(
        ConfigError, match=r"3 lora_path files for the denoisers \['transformer', 'transformer_2'\]"
    ):
        Omni(str(wan_moe_dir), lora_path=paths, max_loras=2)


def test_rule_on_one_denoiser():
    lora = LoRARequest("a", 1, "/a")
    assert assign_denoisers([RequestAdapter(lora), RequestAdapter(lora, 0.5)], ["transformer"], "S") == [
        "transformer",
        "transformer",
    ]
    with pytest.raises(
        InvalidRequestError, match=r"names denoiser 'transformer_2'.*denoisers are \['transformer'\]"
    ):
        assign_denoisers([RequestAdapter(lora, denoiser="transformer_2")], ["transformer"], "S")


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_worker_backends_place_the_pair_the_same_way(backend, wan_moe_dir, loras, reference):
    from vllm_omni import Omni

    with Omni(str(wan_moe_dir), max_loras=2, dtype="float32", worker_backend=backend) as engine:
        got = _latents(engine, lora_requests=[loras["high"], loras["low"]])
        named = _latents(
            engine,
            adapters=[
                RequestAdapter(loras["low"], denoiser="low_noise"),
                RequestAdapter(loras["high"], denoiser="high_noise"),
            ],
        )
    assert _err(got, reference["pair"]) <= TOL and _err(named, reference["pair"]) <= TOL


# ----------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def server(wan_moe_dir, loras, tmp_path_factory):
    from tests.entrypoints.server_utils import console_script, free_port, server_env, start_server

    port = free_port()
    cmd = console_script("vllm-omni") + [
        "serve",
        str(wan_moe_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "wan",
        "--dtype",
        "float32",
        "--max-loras",
        "2",
        "--lora-dirs",
        str(loras["root"]),
        "--disable-uvicorn-access-log",
    ]
    log = tmp_path_factory.mktemp("serve_wan_moe_log") / "server.log"
    env = server_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    srv = start_server(cmd, port, log, env, timeout=900)  # progress-bound: /health, the process
    yield srv
    srv.stop()


def _frames(server, lora: list[dict]) -> np.ndarray | httpx.Response:
    from PIL import Image

    body = {
        "model": "wan",
        "prompt": PROMPT,
        "video_format": "png",
        "seed": SEED,
        "num_frames": NUM_FRAMES,
        "lora": lora,
        **GEN,
    }
    r = HTTP.post(server.url("/v1/videos/generations"), json=body, timeout=300)
    if r.status_code != 200:
        return r
    return np.stack(
        [
            np.asarray(Image.open(io.BytesIO(base64.b64decode(f))).convert("RGB"), dtype=np.int16)
            for f in r.json()["data"][0]["frames"]
        ]
    )


def test_http_pair_and_named_denoisers_match_diffusers(server, wan_moe_dir, loras):
    high, low = loras["high"].lora_path, loras["low"].lora_path
    want = _diffusers(wan_moe_dir, [high], [low], output_type="pil")
    wrong = _diffusers(wan_moe_dir, [high, low], [], output_type="pil")
    assert np.abs(want - wrong).max() > 4  # the placement shows in the frames
    by_position = _frames(server, [{"path": high}, {"path": low}])
    named = _frames(
        server, [{"path": low, "denoiser": "low_noise"}, {"path": high, "denoiser": "transformer"}]
    )
    for got in (by_position, named):
        assert isinstance(got, np.ndarray), got.text[:500]
        assert got.shape == want.shape and np.abs(got - want).max() <= 2


def test_http_ambiguous_and_unknown_denoisers_are_400(server, loras):
    from tests.entrypoints.server_utils import assert_openai_error

    high, low, extra = (loras[k].lora_path for k in ("high", "low", "extra"))
    r = _frames(server, [{"path": high, "denoiser": "high_noise"}, {"path": low}])
    err = assert_openai_error(r, statuses=(400,))
    assert "ambiguous" in err["message"] and 'denoiser="transformer"' in err["message"]
    r = _frames(server, [{"path": high, "denoiser": "middle"}])
    err = assert_openai_error(r, statuses=(400,))
    assert "lora.denoiser" in err["message"] or "lora[0].denoiser" in err["message"]
    assert HTTP.get(server.url("/health")).status_code == 200
    # three unnamed adapters exceed --max-loras 2 first: refused before any target is chosen
    assert_openai_error(_frames(server, [{"path": high}, {"path": low}, {"path": extra}]), statuses=(400,))


def test_http_load_with_a_denoiser_places_the_adapter(server, wan_moe_dir, loras):
    """``POST /v1/load_lora_adapter`` takes ``denoiser`` as ``add_lora(denoiser=...)`` does: a request
    that names the adapter alone puts it on that denoiser (by position it would go on ``transformer``)."""
    from tests.entrypoints.server_utils import assert_openai_error

    low = loras["low"].lora_path
    load = server.url("/v1/load_lora_adapter")
    r = HTTP.post(
        load, json={"lora_name": "low_only", "lora_path": low, "denoiser": "low_noise"}, timeout=300
    )
    assert r.status_code == 200, r.text
    try:
        want = _diffusers(wan_moe_dir, [], [low], output_type="pil")
        by_position = _diffusers(wan_moe_dir, [low], [], output_type="pil")
        assert np.abs(want - by_position).max() > 4  # the placement shows in the frames
        got = _frames(server, [{"name": "low_only"}])
        assert isinstance(got, np.ndarray), got.text[:500]
        assert got.shape == want.shape and np.abs(got - want).max() <= 2
        # a denoiser the stage lacks: 400 naming it, nothing registered, the server keeps serving
        r = HTTP.post(
            load, json={"lora_name": "nowhere", "lora_path": low, "denoiser": "middle"}, timeout=300
        )
        err = assert_openai_error(r, statuses=(400,))
        assert "middle" in err["message"] and "nowhere" in err["message"] and err["param"] == "denoiser", err
        r = HTTP.post(load, json={"lora_name": "nowhere", "lora_path": low, "denoiser": 5}, timeout=300)
        assert assert_openai_error(r, statuses=(400,))["param"] == "denoiser"
        names = [m["id"] for m in HTTP.get(server.url("/v1/models"), timeout=60).json()["data"]]
        assert "nowhere" not in names and "low_only" in names
    finally:
        HTTP.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "low_only"}, timeout=300)
