"""Talk to `vllm serve <model> --omni` with the official `openai` client.

    # text (LLM pipelines): base model, a --lora-modules adapter, and a request-time adapter
    python openai_client.py --base-url http://localhost:8000/v1 --prompt "hello"
    python openai_client.py --model my-adapter
    python openai_client.py --lora-name style --lora-path /srv/loras/style

    # images (diffusion pipelines): writes out_0.png ...
    python openai_client.py --images --prompt "a red fox" --size 256x256 --steps 4 \
        --lora-name style --lora-path /srv/loras/style --lora-scale 0.8

Request-time adapter paths must lie inside one of the server's --lora-dirs.
"""

from __future__ import annotations

import argparse
import base64
import json

from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://localhost:8000/v1")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--model", default=None, help="served model or adapter name (default: first listed)")
    p.add_argument("--prompt", default="hello world")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lora-name", default=None)
    p.add_argument("--lora-path", default=None)
    p.add_argument("--lora-scale", type=float, default=1.0)
    p.add_argument("--images", action="store_true", help="call images.generate instead of chat")
    p.add_argument("--size", default="256x256")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out")
    args = p.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    models = client.models.list().data
    print("models:", json.dumps([{"id": m.id, "parent": getattr(m, "parent", None)} for m in models]))
    model = args.model or models[0].id

    extra: dict = {}
    if args.lora_path:
        extra["lora"] = [
            {"name": args.lora_name or "adapter", "path": args.lora_path, "scale": args.lora_scale}
        ]

    if args.images:
        extra.update(num_inference_steps=args.steps, seed=args.seed, guidance_scale=0.0)
        result = client.images.generate(
            model=model, prompt=args.prompt, n=1, size=args.size, response_format="b64_json", extra_body=extra
        )
        for i, item in enumerate(result.data):
            path = f"{args.out}_{i}.png"
            with open(path, "wb") as f:
                f.write(base64.b64decode(item.b64_json))
            print("image:", path)
        return

    extra.update(ignore_eos=True)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=0.0,
        extra_body=extra,
    )
    print("reply:", json.dumps(reply.choices[0].message.content))


if __name__ == "__main__":
    main()
