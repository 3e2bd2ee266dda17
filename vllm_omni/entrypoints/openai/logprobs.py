"""OpenAI ``logprobs`` objects from vLLM's sample log-probabilities.

vLLM gives, per generated token, a mapping ``token id -> Logprob(logprob, rank, decoded_token)``
holding the sampled token and the ``k`` most likely ones (``SamplingParams.logprobs = k``); the
values are natural-log probabilities (float) of the model's raw distribution (before temperature,
penalties and top-p/top-k), as vLLM's own server returns them.

- Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...k, most likely first]}, ...]}``.
- Completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}
  (k + 1 at most: the sampled token is always there)], "text_offset"}``; ``text_offset``: the
  character offset of each token in the choice's text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _token_text(tokenizer: Any, token_id: int, entry: Any) -> str:
    """The text of one token: vLLM's detokenized piece, else the tokenizer's decoding."""
    text = getattr(entry, "decoded_token", None)
    if text is None and tokenizer is not None:
        text = tokenizer.decode([token_id])
    return text if text is not None else f"token_id:{token_id}"


def _ranked(position: Mapping[int, Any]) -> list[tuple[int, Any]]:
    """``(token id, Logprob)`` of one position, most likely first (by vLLM's rank, then value)."""
    return sorted(position.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))


def chat_logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[Any] | None, top: int
) -> dict[str, Any] | None:
    """The chat ``logprobs`` of generated ``token_ids`` (``None`` when vLLM returned none).

    Args:
        tokenizer: the stage's tokenizer (decodes a token vLLM gave no text for).
        token_ids: the generated tokens (one position each in ``logprobs``).
        logprobs: vLLM's ``CompletionOutput.logprobs`` for these tokens.
        top: ``top_logprobs`` of the request (0 to 20): alternatives listed per token.
    """
    if logprobs is None:
        return None
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        chosen = position[token_id]
        text = _token_text(tokenizer, token_id, chosen)
        alternatives = []
        for alt_id, alt in _ranked(position)[:top]:  # a sampled token outside the top ``top`` sorts last
            alt_text = _token_text(tokenizer, alt_id, alt)
            alternatives.append(
                {
                    "token": alt_text,
                    "logprob": alt.logprob,
                    "bytes": list(alt_text.encode("utf-8", "replace")),
                }
            )
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob,
                "bytes": list(text.encode("utf-8", "replace")),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content}


def completion_logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[Any] | None, offset: int = 0
) -> dict[str, Any] | None:
    """The completions ``logprobs`` of generated ``token_ids`` (``None`` when vLLM returned none).

    ``offset``: characters of the choice's text before these tokens (a stream's earlier pieces).
    """
    if logprobs is None:
        return None
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, logprobs, strict=False):
        chosen = position[token_id]
        text = _token_text(tokenizer, token_id, chosen)
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append(
            {_token_text(tokenizer, alt_id, alt): alt.logprob for alt_id, alt in reversed(_ranked(position))}
        )
        out["text_offset"].append(offset)
        offset += len(text)
    # ``reversed`` above: when two ids decode to the same text, the more likely one's value stays;
    # the dicts are then ordered most likely first
    out["top_logprobs"] = [dict(sorted(d.items(), key=lambda kv: -kv[1])) for d in out["top_logprobs"]]
    return out
