"""Train the demo model in ``examples/demo_model/``: a tiny Z-Image that draws coloured shapes.

Everything runs on CPU in a few minutes from fixed seeds; nothing is downloaded.

* Data: 64x64 images of one shape ("circle", "square", "triangle") in one colour ("red",
  "green", "blue", "yellow") on a plain light background, jittered in position and size;
  the prompt is ``"a <colour> <shape>"``.
* Tokenizer + text encoder: a byte-level BPE tokenizer with a chat template and a randomly
  initialised, frozen ``Qwen3Model`` (different prompts give different features, which is
  all a conditioning signal needs).
* VAE: a 4-block ``AutoencoderKL`` (16 latent channels, 8x down-sampling) trained as an
  autoencoder on the images and on their "warm" / "stripes" versions; ``shift_factor`` and
  ``scaling_factor`` are set from the latent statistics.
* Denoiser: ``ZImageTransformer2DModel`` trained with flow matching under the conventions of
  ``ZImagePipeline``: ``x_s = (1 - s) x0 + s noise``, the model sees ``t = 1 - s`` and predicts
  ``x0 - noise``; sigmas are drawn through the scheduler's shift; 10% empty captions for CFG.
* Adapters: two PEFT LoRAs on the denoiser (``get_peft_model`` + ``save_pretrained``), trained
  on the same layouts with transformed targets: ``warm`` (orange colour grade) and ``stripes``
  (diagonal stripe texture).

Run from the repository root::

    .venv/bin/python -m tools.train_demo_model [--out examples/demo_model] [--stages vae,dit,warm,stripes]

Stages not listed are loaded from ``--out`` (so one part can be retrained alone). Preview PNGs
(diffusers' ``ZImagePipeline`` on the saved directory) go to ``--preview`` when given.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from tools.make_tiny_diffusion import _CHAT_TEMPLATE, _bpe_vocab, _write_model_index

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "examples" / "demo_model"

SIZE = 64
BACKGROUND = (236, 234, 226)
COLOURS = {"red": (214, 38, 38), "green": (36, 160, 64), "blue": (38, 84, 222), "yellow": (242, 198, 24)}
SHAPES = ("circle", "square", "triangle")
VARIANTS = 16  # layouts per prompt
SHIFT = 3.0  # scheduler time shift (static)
HIDDEN = 32  # text encoder width == cap_feat_dim
ADAPTER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
#: What the model is meant to run with (its README's "suggested settings"), written machine-readably into
#: ``model_index.json`` as ``"_call_defaults"``: the server's steps and guidance for a request that sets
#: none, and the ``/ui`` page's (``vllm_omni/config/call_defaults.py``; diffusers ignores ``_`` keys).
SUGGESTED_STEPS = 12
SUGGESTED_GUIDANCE = 3.0


def prompts() -> list[str]:
    """Every training prompt, colour-major."""
    return [f"a {c} {s}" for c in COLOURS for s in SHAPES]


# ---------------------------------------------------------------------------- data
def render(colour: str, shape: str, cx: float, cy: float, r: float, size: int = SIZE) -> torch.Tensor:
    """One anti-aliased image, ``(3, size, size)`` in ``[0, 1]``."""
    ss = 4
    img = Image.new("RGB", (size * ss, size * ss), BACKGROUND)
    draw = ImageDraw.Draw(img)
    cx, cy, r = cx * ss, cy * ss, r * ss
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.86
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=fill)
    img = img.resize((size, size), Image.Resampling.BOX)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255.0


def warm(x: torch.Tensor) -> torch.Tensor:
    """The "warm" effect: an orange colour grade (blue down, red up)."""
    gain = torch.tensor([1.0, 0.72, 0.38]).view(3, 1, 1)
    lift = torch.tensor([0.1, 0.05, 0.0]).view(3, 1, 1)
    return (x * gain + lift).clamp(0, 1)


def stripes(x: torch.Tensor) -> torch.Tensor:
    """The "stripes" effect: bold dark diagonal bands (period 24 px along x + y, soft 2 px edges).

    Coarser than the VAE's 8 px latent cell on purpose: the pattern lives in the latents, so the
    denoiser (and an adapter) can draw it, instead of the decoder having to invent it.
    """
    h, w = x.shape[-2:]
    yy, xx = torch.meshgrid(
        torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
    )
    phase = torch.cos(2 * math.pi * (xx + yy + 0.5) / 24)
    band = ((phase - 0.25) * 2.5).clamp(0, 1)
    return x * (1 - 0.55 * band)


def dataset(variants: int = VARIANTS, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """``(prompt index per image, images (N, 3, SIZE, SIZE))``, deterministic."""
    rng = random.Random(seed)
    idx, images = [], []
    for p, (colour, shape) in enumerate((c, s) for c in COLOURS for s in SHAPES):
        for _ in range(variants):
            cx = SIZE / 2 + rng.uniform(-0.1, 0.1) * SIZE
            cy = SIZE / 2 + rng.uniform(-0.1, 0.1) * SIZE
            r = rng.uniform(0.22, 0.3) * SIZE
            idx.append(p)
            images.append(render(colour, shape, cx, cy, r))
    return idx, torch.stack(images)


def to_pil(x: torch.Tensor) -> Image.Image:
    return Image.fromarray((x.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy())


# ---------------------------------------------------------------------------- components
def build_text_side(out: Path):
    """Write and return ``(tokenizer, text_encoder)`` (random, frozen Qwen3)."""
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

    vocab, merges = _bpe_vocab()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    for tok in specials:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=specials[1:],
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(out / "tokenizer")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=vocab["<|endoftext|>"],
    )
    text_encoder = Qwen3Model(cfg).eval().requires_grad_(False)
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    return tokenizer, text_encoder


@torch.no_grad()
def encode(tokenizer, text_encoder, texts: list[str]) -> list[torch.Tensor]:
    """Caption features exactly as ZImagePipeline computes them (chat template, hidden_states[-2])."""
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        for t in texts
    ]
    enc = tokenizer(chats, padding="longest", return_tensors="pt")
    mask = enc.attention_mask.bool()
    hidden = text_encoder(input_ids=enc.input_ids, attention_mask=mask, output_hidden_states=True)
    return [h[m] for h, m in zip(hidden.hidden_states[-2], mask)]


def new_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        sample_size=SIZE,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def new_transformer():
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(1)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=96,
        n_layers=3,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=HIDDEN,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 8, 8],
        axes_lens=[256, 32, 32],
    )


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _log(name: str, step: int, total: int, loss: float, t0: float) -> None:
    print(f"[{name}] step {step + 1}/{total} loss {loss:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)


# ---------------------------------------------------------------------------- training
def train_vae(images: torch.Tensor, steps: int, batch: int = 16, seed: int = 3):
    """Autoencoder training: L1 + MSE on reconstructions of the posterior mean, plus a small
    latent-norm penalty (the denoiser only ever produces means, so the posterior variance is unused)."""
    vae = new_vae().train()
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps, steps // 20 + 1))
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for step in range(steps):
        x = images[torch.randint(0, len(images), (batch,), generator=g)] * 2 - 1
        z = vae.encode(x).latent_dist.mean
        rec = vae.decode(z + 0.02 * torch.randn(z.shape, generator=g)).sample
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + 1e-4 * z.pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 49 or step == steps - 1:
            _log("vae", step, steps, loss.item(), t0)
    vae.eval().requires_grad_(False)
    return vae


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor) -> torch.Tensor:
    """Raw posterior means ``(N, 16, SIZE/8, SIZE/8)``."""
    return torch.cat([vae.encode(c * 2 - 1).latent_dist.mean for c in images.split(64)])


def train_flow(
    model,
    params: list[torch.nn.Parameter],
    x0: torch.Tensor,
    caption_idx: list[int],
    captions: list[torch.Tensor],
    empty: torch.Tensor,
    *,
    name: str,
    steps: int,
    lr: float,
    batch: int = 32,
    seed: int = 4,
    p_uncond: float = 0.1,
) -> None:
    """Flow-matching training of ``model`` (``ZImageTransformer2DModel``, maybe PEFT-wrapped)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps, steps // 20 + 1))
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, len(x0), (batch,), generator=g)
        u = torch.rand(batch, generator=g)
        sigma = SHIFT * u / (1 + (SHIFT - 1) * u)
        noise = torch.randn(x0[idx].shape, generator=g)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0[idx] + s * noise
        drop = torch.rand(batch, generator=g) < p_uncond
        caps = [empty if d else captions[caption_idx[i]] for i, d in zip(idx.tolist(), drop.tolist())]
        out = model(list(xt.unsqueeze(2).unbind(0)), 1 - sigma, caps, return_dict=False)[0]
        loss = F.mse_loss(torch.stack(out).squeeze(2), x0[idx] - noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 49 or step == steps - 1:
            _log(name, step, steps, loss.item(), t0)
    model.eval()


def train_adapter(base, out: Path, x0, caption_idx, captions, empty, *, name: str, steps: int, seed: int):
    """Train one PEFT LoRA on a copy of ``base`` towards the latents ``x0`` and save it to ``out``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=8, lora_alpha=8, target_modules=ADAPTER_TARGETS, lora_dropout=0.0, init_lora_weights=True
    )
    model = get_peft_model(copy.deepcopy(base).requires_grad_(False), cfg)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    train_flow(model, params, x0, caption_idx, captions, empty, name=name, steps=steps, lr=2e-3, seed=seed)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out))
    cfg_path = out / "adapter_config.json"
    data = json.loads(cfg_path.read_text())
    data["base_model_name_or_path"] = None
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)


# ---------------------------------------------------------------------------- saving / preview
def save_scheduler_and_index(out: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=SHIFT, use_dynamic_shifting=False
    ).save_pretrained(out / "scheduler")
    _write_model_index(
        out,
        "ZImagePipeline",
        {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": ("transformers", "Qwen3Model"),
            "tokenizer": ("transformers", "Qwen2Tokenizer"),
            "transformer": ("diffusers", "ZImageTransformer2DModel"),
            "vae": ("diffusers", "AutoencoderKL"),
        },
    )
    write_call_defaults(out)


def write_call_defaults(out: Path) -> None:
    """Add the suggested steps and guidance to ``out/model_index.json`` (``"_call_defaults"``)."""
    path = out / "model_index.json"
    index = json.loads(path.read_text())
    index["_call_defaults"] = {"guidance_scale": SUGGESTED_GUIDANCE, "num_inference_steps": SUGGESTED_STEPS}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def preview(
    out: Path, dest: Path, steps: int = SUGGESTED_STEPS, guidance: float = SUGGESTED_GUIDANCE
) -> None:
    """One PNG per adapter setting (rows: prompts, columns: seeds) from diffusers' ZImagePipeline."""
    from diffusers import ZImagePipeline
    from safetensors.torch import load_file

    dest.mkdir(parents=True, exist_ok=True)
    pipe = ZImagePipeline.from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    for name in ("warm", "stripes"):
        adir = out / "adapters" / name
        cfg = json.loads((adir / "adapter_config.json").read_text())
        state = {
            k.removeprefix("base_model.model."): v
            for k, v in load_file(str(adir / "adapter_model.safetensors")).items()
        }
        meta = {k: cfg[k] for k in ("r", "lora_alpha", "target_modules") if k in cfg}
        pipe.transformer.load_lora_adapter(state, prefix=None, adapter_name=name, metadata=meta)
    settings = {"base": [0.0, 0.0], "warm": [1.0, 0.0], "stripes": [0.0, 1.0], "both": [1.0, 1.0]}
    for label, scales in settings.items():
        pipe.transformer.set_adapters(["warm", "stripes"], scales)
        rows = []
        for p in prompts():
            imgs = pipe(
                [p] * 4,
                height=SIZE,
                width=SIZE,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=[torch.Generator().manual_seed(s) for s in range(4)],
            ).images
            rows.append(np.concatenate([np.asarray(i) for i in imgs], axis=1))
        Image.fromarray(np.concatenate(rows, axis=0)).save(dest / f"{label}.png")
        print(f"preview: {dest / f'{label}.png'}")


# ---------------------------------------------------------------------------- main
STAGES = ("vae", "dit", "warm", "stripes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES)
    )
    ap.add_argument("--vae-steps", type=int, default=400)
    ap.add_argument("--dit-steps", type=int, default=1600)
    ap.add_argument("--adapter-steps", type=int, default=250)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy host)")
    ap.add_argument("--preview", type=Path, default=None, help="write preview PNGs here")
    args = ap.parse_args(argv)
    stages = {s.strip() for s in args.stages.split(",") if s.strip()}
    if stages - set(STAGES):
        ap.error(f"unknown stages {sorted(stages - set(STAGES))}")
    torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    from diffusers import AutoencoderKL, ZImageTransformer2DModel

    tokenizer, text_encoder = build_text_side(out)
    captions = encode(tokenizer, text_encoder, prompts())
    (empty,) = encode(tokenizer, text_encoder, [""])
    caption_idx, images = dataset()
    effects: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"warm": warm, "stripes": stripes}
    variants = {name: torch.stack([fn(x) for x in images]) for name, fn in effects.items()}

    if "vae" in stages:
        both = torch.stack([warm(stripes(x)) for x in images])
        vae = train_vae(torch.cat([images, *variants.values(), both]), steps=args.vae_steps)
        raw = encode_latents(vae, torch.cat([images, *variants.values()]))
        vae.register_to_config(
            shift_factor=round(raw.mean().item(), 4), scaling_factor=round(1 / raw.std().item(), 4)
        )
        vae.save_pretrained(out / "vae", safe_serialization=True)
    vae = AutoencoderKL.from_pretrained(str(out / "vae")).eval()
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor

    def latents(x: torch.Tensor) -> torch.Tensor:
        return (encode_latents(vae, x) - shift) * scale

    if "dit" in stages:
        transformer = new_transformer()
        train_flow(
            transformer,
            list(transformer.parameters()),
            latents(images),
            caption_idx,
            captions,
            empty,
            name="dit",
            steps=args.dit_steps,
            lr=1e-3,
        )
        transformer.save_pretrained(out / "transformer", safe_serialization=True)
    save_scheduler_and_index(out)
    base = ZImageTransformer2DModel.from_pretrained(str(out / "transformer")).eval()
    for i, name in enumerate(effects):
        if name in stages:
            train_adapter(
                base,
                out / "adapters" / name,
                latents(variants[name]),
                caption_idx,
                captions,
                empty,
                name=name,
                steps=args.adapter_steps,
                seed=10 + i,
            )
    print(f"trained {sorted(stages)} in {time.perf_counter() - t_start:.0f} s -> {out}")
    if args.preview is not None:
        preview(out, args.preview)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
