#!/usr/bin/env bash
# The whole suite on every host of the matrix, one after the other: the bundled ComfyUI 0.3.75 and
# the current ComfyUI 0.33.0 (from ../shared/hosts; said and skipped on a clone without it).
#   REUSEKIT_HOST=0.33 scripts/test.sh     one host only (0.3.75 or 0.33), for quick runs
#   COMFYUI_PATH=/path/to/ComfyUI          your own checkout only (in .venv/)
# Arguments go to pytest (e.g. -m conditioning, -k wan, -x). Exits non-zero if any host failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -n "${COMFYUI_PATH:-}" ]; then
  hosts=(0.3.75)   # .venv/ around the user's checkout
else
  hosts=(${REUSEKIT_HOST:-0.3.75 0.33})
fi

failed=() passed=() skipped=()
for host in "${hosts[@]}"; do
  if [ "$host" = 0.33 ] && ! ls ../shared/hosts/comfyui-0.33.0-*.tar.xz >/dev/null 2>&1 \
       && [ ! -f .host/ComfyUI-0.33.0/main.py ]; then
    echo "[reusekit test] ComfyUI 0.33: SKIPPED (no ../shared/hosts/comfyui-0.33.0-*.tar.xz on this machine)"
    skipped+=(0.33)
    continue
  fi
  scripts/setup.sh --test --host "$host" || { failed+=("$host (setup)"); continue; }
  read -r venv dir < <(scripts/setup.sh --print-host "$host")
  label=$host
  [ -n "${COMFYUI_PATH:-}" ] && label="your checkout at $COMFYUI_PATH"
  echo "[reusekit test] ===== ComfyUI $label ($dir) ====="
  # pytest's own launcher, not `python -m pytest`: that would put this folder on sys.path and the
  # pack's nodes/ and tests/ would shadow ComfyUI's.
  if COMFYUI_PATH="$dir" REUSEKIT_TEST_HOST="$host" "$venv/bin/pytest" "$@"; then
    passed+=("$host")
  else
    failed+=("$host")
  fi
done

echo "[reusekit test] passed on: ${passed[*]:-none}; failed on: ${failed[*]:-none}; skipped: ${skipped[*]:-none}"
[ ${#failed[@]} -eq 0 ] && [ ${#passed[@]} -gt 0 ]
