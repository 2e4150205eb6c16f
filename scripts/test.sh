#!/usr/bin/env bash
# The whole suite on every host of the matrix, one after the other: the bundled ComfyUI 0.3.75 and
# the current ComfyUI 0.33.0 (from ../shared/hosts; said and skipped on a clone without it).
#   REUSEKIT_HOST=0.33 scripts/test.sh     one host only (0.3.75 or 0.33), for quick runs
#   COMFYUI_PATH=/path/to/ComfyUI          your own checkout only (in .venv-user/)
# Arguments go to pytest (e.g. -m conditioning, -k wan, -x). Exits non-zero if any host failed.
# Never hangs: a test past pyproject.toml's timeout fails with every thread's stack, and each host's whole
# run is stopped after REUSEKIT_HOST_TIMEOUT s (default 2700) with a stack dump (SIGABRT: faulthandler); either
# way the host and the test are named below, and where each host's output was kept.
set -uo pipefail
cd "$(dirname "$0")/.."
HOST_LIMIT=${REUSEKIT_HOST_TIMEOUT:-2700}  # 0.33 ran 2053 s on the last CI: room, and a hang still ends within CI's 90 minutes

# The tests that timed out in a host's log, one per line: pytest-timeout's failures, or (the whole run
# stopped) the test frame nearest the top of the main thread's stack in faulthandler's dump.
timed_out() {
  local log=$1 stopped=$2
  grep -oE '^FAILED [^ ]+ - Failed: Timeout' "$log" | sed -E 's/^FAILED ([^ ]+) .*/\1/'
  if [ "$stopped" = 1 ]; then
    sed -n '/^Current thread\|^Thread 0x.*most recent call first/,/^$/p' "$log" \
      | grep -oE 'File "[^"]*/tests/[^"]+", line [0-9]+ in test_[A-Za-z0-9_]+' | head -n 1 \
      | sed -E 's#File "[^"]*/(tests/[^"]+)", line ([0-9]+) in (.*)#\1::\3 (line \2, when the run was stopped)#'
  fi
}

if [ -n "${COMFYUI_PATH:-}" ]; then
  hosts=(0.3.75)   # .venv-user/ around the user's checkout
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
  IFS=$'\t' read -r venv dir < <(scripts/setup.sh --print-host "$host")
  label=$host
  [ -n "${COMFYUI_PATH:-}" ] && label="your checkout at $COMFYUI_PATH"
  echo "[reusekit test] ===== ComfyUI $label ($dir) ====="
  # pytest's own launcher, not `python -m pytest`: that would put this folder on sys.path and the
  # pack's nodes/ and tests/ would shadow ComfyUI's.
  log=$(mktemp -t "reusekit-pytest-$host.XXXXXX.log")
  # each host's temporary folders in one place, removed after a run that passed: the server and disk-tier tests
  # write 2.5 GB in all, and pytest keeps three runs' worth (the last CI ran out of disk installing the second
  # host's venv)
  base=$(mktemp -d -t "reusekit-pytest-$host.XXXXXX")
  COMFYUI_PATH="$dir" REUSEKIT_TEST_HOST="$host" timeout --signal=ABRT --kill-after=60 "$HOST_LIMIT" \
    "$venv/bin/pytest" --basetemp="$base" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  stopped=0
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    stopped=1
    echo "[reusekit test] ComfyUI $label: STOPPED after ${HOST_LIMIT} s (REUSEKIT_HOST_TIMEOUT): a hang; every thread's stack is above"
  fi
  while read -r test; do
    [ -n "$test" ] && echo "[reusekit test] ComfyUI $label: TIMED OUT: $test"
  done < <(timed_out "$log" "$stopped")
  echo "[reusekit test] ComfyUI $label: output kept in $log"
  if [ "$rc" = 0 ]; then
    passed+=("$host")
    rm -rf "$base"
  else
    failed+=("$host")
    echo "[reusekit test] ComfyUI $label: the tests' temporary folders kept in $base"
  fi
done

echo "[reusekit test] passed on: ${passed[*]:-none}; failed on: ${failed[*]:-none}; skipped: ${skipped[*]:-none}"
[ ${#failed[@]} -eq 0 ] && [ ${#passed[@]} -gt 0 ]
