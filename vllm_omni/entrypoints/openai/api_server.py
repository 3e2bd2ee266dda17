"""OpenAI-compatible HTTP server over ``AsyncOmni``.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/images/generations``, ``POST /v1/images/edits``
(multipart), ``POST /v1/videos/generations`` and, when vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set, ``POST /v1/load_lora_adapter`` /
``POST /v1/unload_lora_adapter``.

Handlers only parse and validate, then call ``AsyncOmni``. Every failure is an
OpenAI-style error object (:mod:`.errors`); input problems are 400 (404 for an unknown
``model``), never 500.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vllm_omni.entrypoints.cli.serve import OmniLaunch, ServerSettings
from vllm_omni.entrypoints.openai import media
from vllm_omni.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    error_response,
    install_error_handlers,
    not_found,
)
from vllm_omni.entrypoints.openai.limits import BodySizeLimitMiddleware, max_body_bytes
from vllm_omni.entrypoints.openai.lora import AdapterRegistry, parse_lora_field
from vllm_omni.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageGenerationRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    VideoGenerationRequest,
    parse_body,
)
from vllm_omni.lora.request import LoRARequest, stable_lora_int_id

logger = logging.getLogger(__name__)


def runtime_lora_updating_allowed() -> bool:
    """vLLM's switch for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""
    import vllm.envs as envs

    return bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)


@dataclass
class ServerState:
    """What the handlers share: the engine, the settings and the adapter registry."""

    omni: Any
    settings: ServerSettings
    registry: AdapterRegistry
    base_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    tokenizer: Any = None

    @property
    def config(self):
        return self.omni.config

    @property
    def entry(self):
        return self.config.entry_stage

    @property
    def outputs_images(self) -> bool:
        """Whether a final diffusion stage runs an image (not a video) pipeline."""
        return any(
            s.final_output and not s.is_llm and not _VIDEO_CLASS.search(s.model_arch or "")
            for s in self.config.stages
        )

    @property
    def outputs_text(self) -> bool:
        return any(s.final_output and s.is_llm for s in self.config.stages)

    @property
    def max_adapters(self) -> int:
        """Adapters one request may apply: 1 on an LLM entry stage, ``max_loras`` on a diffusion one."""
        if self.entry.is_llm:
            return 1
        return int(self.entry.options.get("max_loras", 1) or 1)


# ---------------------------------------------------------------- shared helpers
async def read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply") from exc


def resolve_adapters(
    state: ServerState, model: str | None, lora: Any
) -> list[tuple[LoRARequest, float | None]]:
    """Adapters for one request from its ``model`` and ``lora`` fields.

    Raises:
        OpenAIError: 404 for an unknown ``model``; 400 for a malformed or refused ``lora``.
    """
    chosen: list[tuple[LoRARequest, float | None]] = []
    if model is not None and model not in state.registry.base_names:
        if model not in state.registry.named:
            raise not_found(f"The model `{model}` does not exist.", "model")
        chosen.append((state.registry.named[model], None))
    specs = parse_lora_field(lora, max_items=state.max_adapters)
    chosen.extend((state.registry.to_request(spec), spec.scale) for spec in specs)
    ids = [r.lora_int_id for r, _ in chosen]
    if len(set(ids)) != len(ids):
        raise bad_request("the same adapter is given more than once", "lora")
    if len(chosen) > state.max_adapters:
        raise bad_request(
            f"too many adapters: {len(chosen)}; this pipeline applies at most {state.max_adapters} per request",
            "lora",
        )
    if state.entry.is_llm and any(scale not in (None, 1.0) for _, scale in chosen):
        raise bad_request(
            f"{state.entry.label} is an LLM stage: vLLM applies adapters at scale 1.0 only", "lora"
        )
    return chosen


def stage_params(state: ServerState, llm_params: Any, diffusion_params: Any) -> list[Any]:
    return [llm_params if s.is_llm else diffusion_params for s in state.config.stages]


async def run_pipeline(
    state: ServerState, prompt: Any, params: list[Any], adapters: list[tuple[LoRARequest, float | None]]
) -> list[Any]:
    """Run one prompt; engine-side input errors become 400s."""
    from vllm.exceptions import VLLMClientError

    from vllm_omni.errors import StageEngineError

    lora_request = adapters[0][0] if adapters and state.entry.is_llm else None
    outputs = []
    try:
        async for out in state.omni.generate(
            prompt, params, request_id=f"req-{uuid.uuid4().hex}", lora_request=lora_request
        ):
            outputs.append(out)
    except OpenAIError:
        raise
    except StageEngineError as exc:
        raise OpenAIError(str(exc), 500) from exc
    except (ValueError, TypeError, KeyError, VLLMClientError) as exc:
        # InvalidAdapterError, LoRANotEnabledError, vLLM's request validation (prompt too long, ...)
        raise bad_request(str(exc), "lora" if "adapter" in str(exc).lower() else None) from exc
    return outputs


def _text_outputs(outputs: list[Any]) -> Any:
    texts = [o for o in outputs if o.request_output is not None]
    if not texts:
        raise OpenAIError("the pipeline returned no text output", 500)
    return texts[-1].request_output


def _images(outputs: list[Any]) -> list[Any]:
    images = [img for o in outputs for img in (o.images or [])]
    if not images:
        raise OpenAIError("the pipeline returned no image", 500)
    return images


def _usage(ro: Any) -> dict[str, int]:
    prompt = len(ro.prompt_token_ids or [])
    completion = sum(len(c.token_ids) for c in ro.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(chunks: list[dict]) -> Response:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return Response(body, media_type="text/event-stream")


# ---------------------------------------------------------------- chat prompt
def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> dict[str, Any]:
    """Token ids of the templated conversation (as vLLM renders chat: no extra special tokens)."""
    tok = state.tokenizer
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    template = state.settings.chat_template
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    if template is None and not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template")
    try:
        text = tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
            chat_template=template,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors, bad kwargs
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from exc
    return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def _last_user_text(req: ChatCompletionRequest) -> str:
    for m in reversed(req.messages):
        if m.role == "user" and m.text().strip():
            return m.text()
    raise bad_request("messages need a user message with text", "messages")


# ---------------------------------------------------------------- app
def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application for one running ``AsyncOmni`` (see the module docstring)."""
    app = FastAPI(title="vllm-omni", version="0.1")
    app.state.omni_state = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes())

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        keys = state.settings.api_keys
        if keys and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            if header.removeprefix("Bearer ").strip() not in keys:
                return error_response("invalid or missing API key", 401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        def card(name: str, root: str | None, parent: str | None) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "vllm-omni",
                "root": root,
                "parent": parent,
            }

        data = [card(state.base_name, state.config.model, None)]
        data += [card(n, r.lora_path, state.base_name) for n, r in state.registry.named.items()]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(ChatCompletionRequest, await read_json(request))
        adapters = resolve_adapters(state, req.model, req.lora)
        name = req.model or state.base_name
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if state.outputs_text and state.entry.is_llm:
            prompt = chat_prompt(state, req)
            llm = req.model_copy(update={"max_tokens": req.max_completion_tokens or req.max_tokens})
            room = int(state.entry.options.get("max_model_len") or 2048) - len(prompt["prompt_token_ids"])
            params = stage_params(state, llm.sampling_params(max(1, room)), _maybe_diffusion(state, req))
            outputs = await run_pipeline(state, prompt, params, adapters)
            ro = _text_outputs(outputs)
            choices = []
            for i, c in enumerate(ro.outputs):
                choice = {
                    "index": i,
                    "message": {"role": state.settings.response_role, "content": c.text},
                    "finish_reason": c.finish_reason or "stop",
                    "logprobs": None,
                }
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
            body = {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": name,
                "choices": choices,
                "usage": _usage(ro),
            }
            if req.return_token_ids:
                body["prompt_token_ids"] = list(ro.prompt_token_ids or [])
            if req.stream:
                return _sse(_chat_chunks(body))
            return JSONResponse(body)
        # image pipelines: the reply carries the image(s) as data URIs
        prompt = _last_user_text(req)
        dparams = req.diffusion_params(req.n, *_diffusion_lora(state, adapters))
        sp = req.sampling_params() if any(s.is_llm for s in state.config.stages) else None
        outputs = await run_pipeline(state, prompt, stage_params(state, sp, dparams), adapters)
        content = [
            {"type": "image_url", "image_url": {"url": media.png_data_uri(img)}} for img in _images(outputs)
        ]
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": state.settings.response_role, "content": content},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
        return _sse(_chat_chunks(body)) if req.stream else JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(CompletionRequest, await read_json(request))
        if not (state.entry.is_llm and state.outputs_text):
            raise bad_request(f"pipeline {state.config.pipeline.name!r} does not produce text completions")
        if req.echo:
            raise bad_request("echo is not supported", "echo")
        adapters = resolve_adapters(state, req.model, req.lora)
        params = stage_params(state, req.sampling_params(), None)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for prompt in req.prompts():
            ro = _text_outputs(await run_pipeline(state, prompt, params, adapters))
            for c in ro.outputs:
                choice = {
                    "index": len(choices),
                    "text": c.text,
                    "finish_reason": c.finish_reason or "stop",
                    "logprobs": None,
                }
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(ro.prompt_token_ids or [])
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
            for k, v in _usage(ro).items():
                usage[k] += v
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or state.base_name,
            "choices": choices,
            "usage": usage,
        }
        return _sse([body]) if req.stream else JSONResponse(body)

    @app.post("/v1/images/generations")
    async def images_generations(request: Request):
        req = parse_body(ImageGenerationRequest, await read_json(request))
        return JSONResponse(await _generate_images(state, req, req.prompt, image=None))

    @app.post("/v1/images/edits")
    async def images_edits(request: Request):
        fields, image = await media.read_edit_form(request)
        req = parse_body(ImageGenerationRequest, fields)
        return JSONResponse(await _generate_images(state, req, req.prompt, image=image))

    @app.post("/v1/videos/generations")
    async def videos_generations(request: Request):
        req = parse_body(VideoGenerationRequest, await read_json(request))
        if not outputs_video(state):
            raise bad_request(f"pipeline {state.config.pipeline.name!r} does not produce video")
        adapters = resolve_adapters(state, req.model, req.lora)
        dparams = req.diffusion_params(1, *_diffusion_lora(state, adapters))
        sp = _default_llm_params(state)
        outputs = await run_pipeline(state, req.prompt, stage_params(state, sp, dparams), adapters)
        frames = media.video_frames(outputs)
        item: dict[str, Any] = {"num_frames": len(frames), "fps": req.fps}
        if req.video_format == "png":  # lossless: one base64 PNG per frame
            item.update(b64_json=None, format="png", frames=[media.png_b64(f) for f in frames])
        else:
            data, fmt = media.encode_video(frames, req.fps, req.video_format)
            item.update(b64_json=data, format=fmt)
        return JSONResponse({"created": int(time.time()), "data": [item]})

    if runtime_lora_updating_allowed():
        _add_lora_admin_routes(app, state)
    return app


def _chat_chunks(body: dict) -> list[dict]:
    chunks = []
    for choice in body["choices"]:
        base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        delta = {"role": choice["message"]["role"], "content": choice["message"]["content"]}
        chunks.append(base | {"choices": [{"index": choice["index"], "delta": delta, "finish_reason": None}]})
        chunks.append(
            base
            | {"choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]}
        )
    return chunks


def _diffusion_lora(state: ServerState, adapters: list[tuple[LoRARequest, float | None]]):
    """``(lora_requests, lora_scales)`` for a diffusion entry stage; no scales given -> stage defaults."""
    if state.entry.is_llm:  # the adapter goes to the entry LLM stage, not the diffusion stage
        return [], []
    if all(s is None for _, s in adapters):
        return [r for r, _ in adapters], []
    # some scales given: an unset one is the stage's lora_scale for its start-up (lora_path) adapters,
    # as when none is given, and 1.0 otherwise
    options = state.entry.options
    paths = options.get("lora_path")
    startup_ids = (
        {stable_lora_int_id(p) for p in ([paths] if isinstance(paths, str) else list(paths or []))}
        if options.get("lora_backend", "peft") == "peft"
        else set()
    )
    default = float(options.get("lora_scale", 1.0))
    scales = [s if s is not None else (default if r.lora_int_id in startup_ids else 1.0) for r, s in adapters]
    return [r for r, _ in adapters], scales


def _maybe_diffusion(state: ServerState, req: ChatCompletionRequest):
    """Diffusion params for the diffusion stages behind an LLM entry stage (none: ``None``)."""
    if all(s.is_llm for s in state.config.stages):
        return None
    return req.diffusion_params(1)


_VIDEO_CLASS = re.compile(r"(Video|Wan|Mochi|LTX|Allegro|Latte)", re.IGNORECASE)


def accepts_input_image(stage: Any) -> bool:
    """Whether a diffusion stage can take an input image.

    In-tree pipelines here are text-to-image (they would ignore an image); the diffusers
    fallback passes ``image`` on and fails clearly when its pipeline does not take one.
    """
    if stage.is_llm:
        return False
    from vllm_omni.diffusion.data import in_tree_pipeline_classes

    backend = stage.options.get("pipeline_backend", "auto")
    return backend == "diffusers" or stage.model_arch not in in_tree_pipeline_classes()


def outputs_video(state: ServerState) -> bool:
    """Whether a final diffusion stage runs a video pipeline (by its pipeline class name)."""
    return any(
        s.final_output and not s.is_llm and _VIDEO_CLASS.search(s.model_arch or "")
        for s in state.config.stages
    )


def _default_llm_params(state: ServerState):
    if not any(s.is_llm for s in state.config.stages):
        return None
    from vllm import SamplingParams

    return SamplingParams(max_tokens=64)


async def _generate_images(state: ServerState, req: ImageGenerationRequest, prompt: str, image: Any) -> dict:
    if not state.outputs_images:
        raise bad_request(f"pipeline {state.config.pipeline.name!r} does not produce images")
    adapters = resolve_adapters(state, req.model, req.lora)
    dparams = req.diffusion_params(req.n, *_diffusion_lora(state, adapters))
    if image is not None:
        if not accepts_input_image(state.entry):
            raise bad_request(
                f"pipeline {state.config.pipeline.name!r} ({state.entry.model_arch}) generates from text only; "
                f"/v1/images/edits needs an image-to-image pipeline",
                "image",
            )
        dparams.extra_args["image"] = image
    sp = _default_llm_params(state)
    outputs = await run_pipeline(state, prompt, stage_params(state, sp, dparams), adapters)
    return {
        "created": int(time.time()),
        "data": [{"b64_json": media.png_b64(img)} for img in _images(outputs)],
    }


def _add_lora_admin_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        from vllm_omni.errors import LoRANotEnabledError

        req = parse_body(LoadLoRAAdapterRequest, await read_json(request))
        reg = state.registry
        if req.lora_name in reg.base_names:
            raise bad_request(f"'{req.lora_name}' is the base model's name", "lora_name")
        if req.lora_name in reg.named and not req.load_inplace:
            raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
        location = reg.resolve_path(req.lora_path)
        int_id = stable_lora_int_id(location)
        reg.claim_id(int_id, location)
        lora = LoRARequest(req.lora_name, int_id, location)
        try:
            await state.omni.add_lora(lora)  # False only means "already cached"
        except (LoRANotEnabledError, ValueError) as exc:
            raise bad_request(str(exc), "lora_path") from exc
        reg.add_named(lora)
        return Response(
            f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain"
        )

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = parse_body(UnloadLoRAAdapterRequest, await read_json(request))
        lora = state.registry.remove_named(req.lora_name)
        try:
            await state.omni.remove_lora(lora.lora_int_id)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from exc
        return Response(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain"
        )


# ---------------------------------------------------------------- start-up
async def register_startup_adapters(state: ServerState) -> None:
    """Load ``--lora-modules`` on every LoRA stage and allow ``--lora-path`` / module paths.

    Raises:
        ValueError: an adapter that cannot be served (the server does not start).
    """
    reg = state.registry
    entry = state.entry
    lora_path = entry.options.get("lora_path") if not entry.is_llm else None
    for path in [lora_path] if isinstance(lora_path, str) else list(lora_path or []):
        reg.register_startup_path(path)
        if entry.options.get("lora_backend", "peft") == "peft":
            # pre-loaded and pinned by the stage under this name and id (see diffusion.worker_lora)
            from vllm_omni.diffusion.worker_lora import startup_lora_request

            lora = startup_lora_request(path)
            if lora.lora_name not in reg.named and lora.lora_name not in reg.base_names:
                reg.add_named(lora)
    for name, path in state.settings.lora_modules:
        location = reg.register_startup_path(path)
        lora = LoRARequest(name, stable_lora_int_id(location), location)
        try:
            await state.omni.add_lora(lora)
        except Exception as exc:
            raise ValueError(f"--lora-modules {name}={path}: {exc}") from exc
        reg.add_named(lora)


def make_state(omni: Any, settings: ServerSettings) -> ServerState:
    config = omni.config
    base = settings.served_model_names[0] if settings.served_model_names else (config.model or "model")
    names = list(
        dict.fromkeys([base, *settings.served_model_names, *([config.model] if config.model else [])])
    )
    registry = AdapterRegistry(settings.lora_dirs, settings.allow_remote_lora, names)
    state = ServerState(omni=omni, settings=settings, registry=registry, base_name=base)
    entry = config.entry_stage
    if entry.is_llm and entry.model:
        from transformers import AutoTokenizer

        state.tokenizer = AutoTokenizer.from_pretrained(
            entry.options.get("tokenizer") or entry.model,
            trust_remote_code=bool(entry.options.get("trust_remote_code", False)),
        )
    return state


def run_server(launch: OmniLaunch, settings: ServerSettings) -> None:
    """Start the pipeline's engines, then serve HTTP until interrupted."""
    import asyncio

    import uvicorn

    from vllm_omni.entrypoints.async_omni import AsyncOmni

    omni = AsyncOmni(launch.model, **launch.omni_kwargs())
    try:
        state = make_state(omni, settings)
        asyncio.run(register_startup_adapters(state))
        app = build_app(state)
        logger.info("serving %s on %s:%s", state.base_name, settings.host or "0.0.0.0", settings.port)
        uvicorn.run(
            app,
            host=settings.host or "0.0.0.0",
            port=settings.port,
            log_level=settings.uvicorn_log_level,
            access_log=not settings.disable_uvicorn_access_log,
        )
    finally:
        omni.shutdown()
