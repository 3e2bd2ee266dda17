"""Wan text-to-video pipeline (Wan2.1, Wan2.2 A14B two-expert, Wan2.2 TI2V-5B) around the in-tree denoiser.

Components come from one diffusers-format directory (``model_index.json``): the T5 tokenizer and
``UMT5EncoderModel`` through ``transformers``, ``AutoencoderKLWan``, the scheduler and
``VideoProcessor`` through ``diffusers``, and the denoiser(s) from
:class:`~vllm_omni.diffusion.models.wan.WanTransformer3DModel`. The sampling procedure is
diffusers' ``WanPipeline.__call__``:

1. prompts are cleaned (diffusers' ``prompt_clean``), tokenised to ``max_sequence_length``, encoded,
   and the embeddings past each prompt's length are zeroed (the denoiser attends to the padding).
2. CFG runs when ``guidance_scale > 1`` with ``pred = neg + g * (pos - neg)`` (negative prompt
   defaults to ``""``); both branches go through the denoiser in one batch.
3. ``scheduler.set_timesteps(steps)``; with ``boundary_ratio`` (Wan2.2 A14B) the steps whose timestep
   is ``>= boundary_ratio * num_train_timesteps`` run ``transformer`` (high noise, guidance
   ``guidance_scale``), the others ``transformer_2`` (low noise, ``guidance_scale_2``, default
   ``guidance_scale``). The expert switch is a step boundary: a step runs one expert.
4. latents ``(B, C, (num_frames - 1) / t + 1, H / s, W / s)`` (``t``, ``s``: the VAE's temporal and
   spatial factors) are decoded as ``vae.decode(latents * std + mean)`` and post-processed.

``expand_timesteps`` (Wan2.2 TI2V-5B, whose published ``model_index.json`` names ``WanPipeline``) gives the
denoiser one timestep per token, as diffusers does: in text-to-video every token has the step's. The same
folder also makes image-to-video, as diffusers' ``WanImageToVideoPipeline.from_pretrained`` runs it: a request
with ``extra_args["image"]`` gets the image VAE-encoded (one latent frame, normalised) as the clean first
latent frame of every step's input and of the result, whose tokens get timestep 0 (:class:`Conditioning`).
Requests without an image are text-to-video; the stage batches the two kinds apart (their ``extra_args``
differ), so one denoiser batch is all text-to-video or all image-to-video.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from diffusers import AutoencoderKLWan
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.video_processor import VideoProcessor

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.wan import WanTransformer3DModel
from vllm_omni.diffusion.pipelines import diffusers_dtype_kwargs
from vllm_omni.diffusion.pipelines.base import resolve_image_size
from vllm_omni.diffusion.pipelines.template import DenoiseState, DiTPipeline, RequestOptions
from vllm_omni.errors import InvalidRequestError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

#: diffusers' ``WanPipeline`` defaults
DEFAULT_SIZE = (480, 832)
DEFAULT_FRAMES = 81
DEFAULT_GUIDANCE = 5.0
#: ``extra_args`` of the Wan family (diffusers' call argument of the same name; ``guidance_scale_2`` and
#: ``attention_kwargs`` are every family's, :mod:`~vllm_omni.diffusion.pipelines.template`)
EXTRA_ARGS = ("num_frames",)
#: the input image(s) of a request, diffusers' call arguments of the same names
IMAGE_ARGS = ("image", "last_image")


class Conditioning(NamedTuple):
    """What the denoiser sees beside the noisy latents of a call (all ``None``: text-to-video).

    Attributes:
        channels: ``(B, c, f, h, w)`` concatenated after the latent channels every step (Wan2.1 / A14B I2V).
        image_embeds: ``(k, L, d)`` image cross-attention features, repeated per sample (Wan2.1 I2V).
        first_frame: ``(B, C, 1, h, w)`` the clean first latent frame (Wan2.2 TI2V-5B image-to-video,
            ``expand_timesteps``): it replaces the first latent frame of the denoiser's input every step
            and of the result, and that frame's tokens get timestep 0 (diffusers' ``first_frame_mask``).
    """

    channels: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    first_frame: torch.Tensor | None = None


def with_first_frame(latents: torch.Tensor, first_frame: torch.Tensor | None) -> torch.Tensor:
    """``latents`` ``(B, C, F, h, w)`` with latent frame 0 replaced by ``first_frame`` (a copy; unchanged
    without one). diffusers mixes ``(1 - mask) * first + mask * latents`` with a 0/1 mask: the same values."""
    if first_frame is None:
        return latents
    return torch.cat([first_frame.to(latents.dtype), latents[:, :, 1:]], dim=2)


def first_frame_timesteps(
    t: torch.Tensor, latent_shape, patch_size, first_frame: bool = True
) -> torch.Tensor:
    """Per-token timesteps ``(F' * H' * W',)`` of a latent ``(..., F, h, w)`` patched by ``patch_size``:
    ``t`` everywhere but (with ``first_frame``) 0 on the tokens of latent frame 0 (diffusers'
    ``first_frame_mask`` sampled at every patch's corner, times ``t``)."""
    mask = torch.ones(latent_shape[-3:], dtype=torch.float32, device=t.device)
    if first_frame:
        mask[0] = 0
    p_t, p_h, p_w = patch_size
    return (mask[::p_t, ::p_h, ::p_w] * t).flatten()


# ---------------------------------------------------------------------- the pipeline
class WanPipeline(DiTPipeline):
    """Wan text-to-video on the in-tree denoiser(s) (one instance per TP rank).

    Attributes:
        transformer: the (high-noise) :class:`WanTransformer3DModel`; LoRA patches it.
        transformer_2: the low-noise expert of Wan2.2 A14B directories, else ``None``.
        boundary_ratio: expert switch (``model_index.json``), ``None`` with one expert.
        expand_timesteps: the Wan2.2 TI2V-5B layout (``model_index.json``): per-token timesteps, and an
            optional input image (``accepts_image``; image-to-video as in the module docstring).
        accepts_image / requires_image: whether a request may / must carry ``extra_args["image"]``.
        text_encoder, tokenizer, vae, scheduler, video_processor: the library components.
        vae_scale_factor: spatial VAE compression; sizes must be multiples of twice it.

    Must be constructed after ``init_diffusion_parallel_state`` in the same process.
    """

    family = "wan"
    output_kind = "video"
    #: the family's own ``extra_args`` keys
    extra_args_taken: tuple[str, ...] = EXTRA_ARGS

    def __init__(self, od_config: OmniDiffusionConfig, device: str | torch.device | None = None):
        root = self._load_text_and_scheduler(od_config, device)
        comps = od_config.components
        self.vae = AutoencoderKLWan.from_pretrained(str(root / "vae"), **diffusers_dtype_kwargs(self.dtype))
        self.vae.to(self.device).eval().requires_grad_(False)
        experts = [name for name in ("transformer", "transformer_2") if comps.get(name)]
        if "transformer" not in experts:
            raise InvalidRequestError(f"{root}: the in-tree Wan pipeline needs a 'transformer' component")
        loaded = {
            name: WanTransformer3DModel.from_pretrained(
                root / name,
                dtype=self.dtype,
                device=self.device,
                keep_base_weights=od_config.keep_base_weights,
            )
            for name in experts
        }
        self.transformer = loaded["transformer"]
        self.transformer_2 = loaded.get("transformer_2")
        self.boundary_ratio = od_config.model_index.get("boundary_ratio")
        self.two_experts = self.transformer_2 is not None
        if self.transformer_2 is not None and self.boundary_ratio is None:
            raise InvalidRequestError(
                f"{root}: transformer_2 is present but model_index.json sets no boundary_ratio"
            )
        self.vae_scale_factor = int(self.vae.config.scale_factor_spatial)
        self.vae_scale_factor_temporal = int(self.vae.config.scale_factor_temporal)
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor)
        self.expand_timesteps = bool(od_config.model_index.get("expand_timesteps"))
        self.accepts_image, self.requires_image = self.expand_timesteps, False
        if self.expand_timesteps:
            self.extra_args_taken = EXTRA_ARGS + IMAGE_ARGS

    # ------------------------------------------------------------------ sizes
    @property
    def max_image_size(self) -> tuple[int, int]:
        """Largest ``(height, width)`` in pixels the rotary table reaches (``rope_max_seq_len`` patches)."""
        _, p_h, p_w = self.transformer.patch_size
        reach = self.transformer.rope.max_seq_len * self.vae_scale_factor
        return reach * p_h, reach * p_w

    def resolve_size(self, sp: OmniDiffusionSamplingParams, condition=None) -> tuple[int, int]:
        """``(height, width)``: the request's, else diffusers' 480x832 bounded by :attr:`max_image_size`.

        Raises:
            InvalidRequestError: a side that is not a multiple of ``2 * vae_scale_factor`` or beyond the limit.
        """
        factor = self.vae_scale_factor * 2
        defaults = tuple(
            min(d, limit) // factor * factor for d, limit in zip(DEFAULT_SIZE, self.max_image_size)
        )
        return resolve_image_size(sp, defaults, factor, self.max_image_size)

    def resolve_frames(self, value) -> int:
        """``num_frames`` (``extra_args``; default 81): ``1 + k * temporal factor`` up to the rotary reach.

        Raises:
            InvalidRequestError: not such a count (diffusers rounds it silently; we name it instead).
        """
        t = self.vae_scale_factor_temporal
        frames = DEFAULT_FRAMES if value is None else value
        reach = (self.transformer.rope.max_seq_len * self.transformer.patch_size[0] - 1) * t + 1
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % t:
            raise InvalidRequestError(
                f"num_frames must be 1 + a multiple of {t} (the VAE's temporal compression), e.g. "
                f"{t + 1}, {4 * t + 1}, 81; got {frames!r}"
            )
        if frames > reach:
            raise InvalidRequestError(f"num_frames {frames} exceeds this model's maximum of {reach}")
        return frames

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_t5(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """UMT5 features ``(len(prompts), max_sequence_length, d)`` in the denoiser dtype, zero past each
        prompt's tokens (diffusers' ``_get_t5_prompt_embeds``)."""
        enc = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = enc.attention_mask.to(self.device)
        hidden = self.text_encoder(enc.input_ids.to(self.device), mask).last_hidden_state
        hidden = (
            hidden
            * (torch.arange(hidden.shape[1], device=self.device)[None, :] < mask.sum(1)[:, None])[..., None]
        )
        return hidden.to(self.transformer.dtype)

    # ------------------------------------------------------------------ template hooks
    def default_guidance(self) -> float:
        """diffusers' ``WanPipeline`` default: 5.0."""
        return DEFAULT_GUIDANCE

    def family_options(self, extra: dict, options: RequestOptions) -> None:
        """``num_frames`` (default 81; :meth:`resolve_frames`)."""
        options.extra["frames"] = self.resolve_frames(extra.get("num_frames"))

    def prepare_condition(self, sp: OmniDiffusionSamplingParams, options: RequestOptions) -> list:
        """The request's input images, checked (:meth:`_input_images`); encoded once the size is known."""
        return self._input_images(sp)

    def noise_shape(self, options: RequestOptions, condition) -> tuple[int, int, int, int]:
        """``(C, (num_frames - 1) / t + 1, H / s, W / s)``."""
        return (
            self.transformer.out_channels,
            (options.extra["frames"] - 1) // self.vae_scale_factor_temporal + 1,
            options.height // self.vae_scale_factor,
            options.width // self.vae_scale_factor,
        )

    def encode_prompts(self, texts: list[str], options: RequestOptions, sp, condition) -> torch.Tensor:
        """UMT5 features of ``texts`` (:meth:`encode_t5`)."""
        return self.encode_t5(texts, sp.max_sequence_length)

    def build_state(self, state: DenoiseState, sp) -> None:
        """The request's :class:`Conditioning` (input images VAE-encoded at the request size)."""
        o = state.options
        state.condition = self._conditioning(sp, (state.batch,), o.extra["frames"], o.height, o.width)

    def model_input(
        self, state: DenoiseState, latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """The rows' latents (first latent frame replaced by a given image's), conditioning channels appended,
        in the denoiser dtype."""
        cond = state.condition
        x = with_first_frame(latents, cond.first_frame)
        x = x if cond.channels is None else torch.cat([x, cond.channels], dim=1)
        return x.to(self.transformer.dtype)

    def predict(self, state: DenoiseState, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Each row on the expert of its timestep (rows on one expert share a call); per-token timesteps
        with ``expand_timesteps`` (0 on a given first frame's tokens). Float32."""
        experts = [self.expert_for(float(t))[1] for t in timesteps]
        if len(set(experts)) == 1:
            return self._run_expert(state, experts[0], x, timesteps, state.text)
        out = torch.empty(0)
        for expert in sorted(set(experts)):
            rows = torch.tensor([i for i, e in enumerate(experts) if e == expert], device=x.device)
            part = self._run_expert(state, expert, x[rows], timesteps[rows], state.text[rows])
            if out.numel() == 0:
                out = part.new_empty((x.shape[0], *part.shape[1:]))
            out[rows] = part
        return out

    def _run_expert(self, state: DenoiseState, expert: int, x: torch.Tensor, timesteps: torch.Tensor, text):
        model = self.transformer if expert == 0 else self.transformer_2
        cond = state.condition
        if self.expand_timesteps:  # per token, 0 on a given first frame's (diffusers' mask)
            ones = torch.ones((), dtype=torch.float32, device=x.device)
            mask = first_frame_timesteps(ones, x.shape, model.patch_size, cond.first_frame is not None)
            timestep = mask[None, :] * timesteps[:, None]
        else:
            timestep = timesteps
        image = None if cond.image_embeds is None else cond.image_embeds.repeat(x.shape[0], 1, 1)
        return model(x, timestep, text, image).float()

    def combine_cfg(self, state: DenoiseState, out: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """``neg + g * (pos - neg)`` with each row's expert's scale (``guidance_scale`` / ``guidance_scale_2``)."""
        batch = out.shape[0] // 2
        pos, neg = out[:batch], out[batch:]
        scales = (state.options.guidance, state.options.guidance_2)
        experts = [self.expert_for(float(t))[1] for t in timesteps]
        if len(set(experts)) == 1:
            return neg + scales[experts[0]] * (pos - neg)
        g = torch.tensor([scales[e] for e in experts], dtype=out.dtype, device=out.device)
        return neg + g.view(-1, *([1] * (out.dim() - 1))) * (pos - neg)

    def finish_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """The result's first latent frame is the given image's (TI2V image-to-video)."""
        return with_first_frame(latents, state.condition.first_frame)

    def decode_into(self, results, latents: torch.Tensor, state: DenoiseState, sp) -> None:
        """VAE-decode and attach the videos."""
        self._decode_into(results, latents, sp.output_type, state.options.n)

    def expert_for(self, timestep: float) -> tuple[WanTransformer3DModel, int]:
        """The denoiser of a step and its index into the guidance pair (0: high noise, 1: low noise)."""
        if self.boundary_ratio is None:
            return self.transformer, 0
        boundary = self.boundary_ratio * self.scheduler.config.num_train_timesteps
        return (self.transformer, 0) if timestep >= boundary else (self.transformer_2, 1)

    def _input_images(self, sp) -> list:
        """``[]`` (text-to-video), ``[image]`` or ``[image, last_image]`` from ``extra_args``.

        Raises:
            InvalidRequestError: no ``image`` where :attr:`requires_image` (naming the argument to pass); a
                ``last_image`` without an ``image``, or for the ``expand_timesteps`` layout.
        """
        image, last = sp.extra_args.get("image"), sp.extra_args.get("last_image")
        if image is None and (self.requires_image or last is not None):
            raise InvalidRequestError(
                f"{type(self).__name__} needs an input image: pass extra_args['image'] (a PIL image, "
                "numpy array or tensor)"
            )
        if last is not None and self.expand_timesteps:
            raise InvalidRequestError(
                "extra_args['last_image'] is not used by expand_timesteps image-to-video (Wan2.2 TI2V-5B "
                "conditions on the first frame only); pass extra_args['image'] alone"
            )
        return [im for im in (image, last) if im is not None]

    def _pixels(self, images: list, height: int, width: int) -> list[torch.Tensor]:
        """Each image ``(1, 3, height, width)`` float32 in [-1, 1] (``VideoProcessor.preprocess``).

        Raises:
            InvalidRequestError: an input that is not an image.
        """
        try:
            return [
                self.video_processor.preprocess(im, height=height, width=width).to(self.device, torch.float32)
                for im in images
            ]
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"extra_args['image'] cannot be read as an image: {exc}") from exc

    @torch.no_grad()
    def _conditioning(self, sp, shape, frames: int, height: int, width: int) -> Conditioning:
        """What the denoiser sees beside the latents of the batch of ``shape``: nothing (text-to-video), or
        with ``expand_timesteps`` and an image ``first_frame`` ``(B, z_dim, 1, h, w)`` (other image-to-video
        layouts: :class:`~vllm_omni.diffusion.models.wan.pipeline_i2v.WanImageToVideoPipeline`)."""
        images = self._input_images(sp)
        if not images:
            return Conditioning()
        first = self._encode(self._pixels(images[:1], height, width)[0].unsqueeze(2))
        return Conditioning(first_frame=first.repeat(shape[0], 1, 1, 1, 1))

    def _encode(self, video: torch.Tensor) -> torch.Tensor:
        """The VAE latent (the distribution's mode) of ``video`` ``(1, 3, F, H, W)``, float32, normalised
        ``(z - mean) / std``."""
        latent = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().to(torch.float32)
        mean, inv_std = self.latent_stats(latent)
        return (latent - mean) * inv_std

    def latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent ``mean`` and ``1 / std``, ``(1, z_dim, 1, 1, 1)`` on ``like``'s device
        and dtype (a VAE latent ``z`` is normalised as ``(z - mean) * inv_std``)."""
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like)
        return mean, 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like)

    def _decode_into(
        self, results: list[DiffusionOutput], latents: torch.Tensor, output_type: str, n: int
    ) -> None:
        """Decode with the VAE (``latents * std + mean``) and give each result its ``n`` videos."""
        latents = latents.to(self.vae.dtype)
        mean, inv_std = self.latent_stats(latents)
        video = self.vae.decode(latents / inv_std + mean, return_dict=False)[0]
        video = self.video_processor.postprocess_video(video, output_type=output_type)
        for i, res in enumerate(results):
            chunk = video[i * n : (i + 1) * n]
            if output_type == "pil":
                res.videos = [list(frames) for frames in chunk]
            else:
                res.array = chunk
