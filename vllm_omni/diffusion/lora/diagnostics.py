"""Why an adapter's module keys bind to nothing: what the model offers instead.

A refused adapter key is explained with what the model would have accepted (:func:`explain_unmatched`):

* the key *ends with* one of the model's names but starts with a prefix the model does not use (the
  usual mistake: an adapter saved from a wrapper, ``model.diffusion_model.layers.0.attention.to_q``):
  the prefix to drop is named;
* a leaf key (``to_q``) that fits several layers: how many, and a few of them;
* otherwise the nearest names the model offers (``difflib``), and the prefixes its keys start with.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

#: Unmatched keys explained one by one in a message; the rest are only counted.
EXPLAINED_KEYS = 6
#: Model names searched for near matches (a denoiser has a few thousand LoRA-capable names at most).
_MAX_SEARCHED = 20000


def key_prefixes(names: Iterable[str], top: int = 4) -> list[str]:
    """The first components (``"layers."``) the model's names start with, most common first."""
    counts = Counter(name.split(".", 1)[0] + "." for name in names)
    return [prefix for prefix, _ in counts.most_common(top)]


def explain_key(key: str, names: Sequence[str], leaf_matches: Callable[[str], list[str]]) -> str:
    """One line about ``key``: the prefix to drop, the layers a leaf key fits, or the nearest names.

    Args:
        key: the adapter's module key, as in its file.
        names: the model's LoRA-capable layer and sub-layer names.
        leaf_matches: the names whose last components are the key's (``TargetIndex.leaf_matches``).
    """
    hits = leaf_matches(key)
    if len(hits) > 1:
        return f"{key!r} fits {len(hits)} layers by its last components (e.g. {hits[:3]}); give the full name"
    endings = sorted((n for n in names if key.endswith("." + n)), key=len, reverse=True)
    if endings:
        prefix = key[: -len(endings[0])]
        return (
            f"{key!r} ends with the model's {endings[0]!r}: the prefix {prefix!r} is not one the model uses"
        )
    near = difflib.get_close_matches(key, list(names)[:_MAX_SEARCHED], n=3, cutoff=0.5)
    if near:
        return f"{key!r}: did you mean {' or '.join(repr(n) for n in near)}?"
    return f"{key!r}: no module of the model is close"


def explain_unmatched(
    unmatched: Sequence[str], names: Sequence[str], leaf_matches: Callable[[str], list[str]]
) -> str:
    """A refusal's explanation of ``unmatched`` keys: the first :data:`EXPLAINED_KEYS` one per line
    (:func:`explain_key`), then the prefixes the model's keys start with."""
    keys = sorted(unmatched)
    lines = [explain_key(k, names, leaf_matches) for k in keys[:EXPLAINED_KEYS]]
    if len(keys) > EXPLAINED_KEYS:
        lines.append(f"(+{len(keys) - EXPLAINED_KEYS} more unmatched keys)")
    prefixes = key_prefixes(names)
    lines.append(
        f"keys here start with {' or '.join(repr(p) for p in prefixes)} (e.g. {sorted(names)[:1]})"
        if prefixes
        else "the model has no LoRA-capable layer selected (check target_modules)"
    )
    return "; ".join(lines)
