"""Hypothesis strategies for (mostly malformed) ``lora`` request fields."""

from __future__ import annotations

from hypothesis import strategies as st

KEYS = ["name", "lora_name", "path", "local_path", "scale", "int_id", "rank", "", "Name", "weight"]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
paths = st.sampled_from(
    ["/", "/etc/passwd", "..", "../../x", "/tmp/../etc", "a/b", "hf://x/y", "http://h/x.safetensors", "", " "]
) | st.text(max_size=30)


def lora_entries():
    """Objects with plausible keys and values of arbitrary (often wrong) types."""
    return st.dictionaries(
        st.sampled_from(KEYS),
        json_values | paths | st.floats(min_value=-1e12, max_value=1e12),
        max_size=5,
    )


def lora_values():
    """A whole ``lora`` field: anything JSON, an entry, or a list of entries."""
    return json_values | lora_entries() | st.lists(lora_entries() | json_values, max_size=20)
