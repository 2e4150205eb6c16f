#!/usr/bin/env bash
# ReuseKit's GPU checks in one call: the `gpu` tests, bench/graph_reuse.py and bench/pe_cache_gpu.py
# (one Flux and one Wan forward with the PE cache on against off), on both hosts.
#
#   scripts/gpu_check.sh --prepare   here (with a package index): fills .devcarry/ (git-ignored) with
#                                    cp312 wheels of what a bare GPU machine lacks and the two host
#                                    trees packed (without tests, __pycache__ and the big LLM tokenizers)
#   scripts/gpu_check.sh [HOST...]   on the GPU machine, .devcarry carried: installs the wheels into
#                                    /tmp/rk-site, unpacks the hosts into /tmp/rk-hosts, runs the checks
#                                    and writes one log per check and summary.txt to $OUT
#   scripts/gpu_check.sh --dry-run   here, without a GPU: bench/pe_cache_gpu.py at tiny sizes on the
#                                    CPU with the local venvs (checks it runs; prints no GPU figures)
#
# HOST is ComfyUI (0.3.75) or ComfyUI-0.33.0 (default: both). Time limits per check, in seconds:
# GPU_CHECK_TEST_S (default 150), GPU_CHECK_BENCH_S (default 90) and GPU_CHECK_PE_S (default 45);
# both hosts fit in one 10-minute call.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$ROOT/.devcarry
HOSTS=(ComfyUI ComfyUI-0.33.0)
# distributions the hosts import that the GPU machine's image lacks (pinned to the versions of .venv-0.33)
NEEDED=(av torchsde trampoline pydantic pydantic-core pydantic-settings annotated-types typing-inspection
        python-dotenv SQLAlchemy alembic Mako blake3 comfy-aimdo simpleeval)
# ComfyUI 0.33 imports comfy_kitchen unconditionally (comfy/ldm/modules/attention.py): its pure-Python
# wheel of the same version (0.2 MB, the eager backend) travels instead of the 58 MB one with CUDA kernels
PURE=(comfy-kitchen)

prepare() {
    local py=$ROOT/.venv-0.33/bin/python
    rm -rf "$CARRY" && mkdir -p "$CARRY/whl" || exit 1
    for dist in "${NEEDED[@]}"; do
        local version
        version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist") || exit 1
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$CARRY/whl" "$dist==$version" \
            || { echo "gpu_check: no cp312 wheel of $dist==$version" >&2; exit 1; }
    done
    for dist in "${PURE[@]}"; do
        local version
        version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist") || exit 1
        "$py" -m pip download -q --no-deps --only-binary=:all: --platform any -d "$CARRY/whl" "$dist==$version" \
            || { echo "gpu_check: no pure-Python wheel of $dist==$version" >&2; exit 1; }
    done
    # a host's own folders of models, inputs, outputs and user data stay behind: named from the host's root,
    # since a pattern such as */input/* would also drop packages of that name (comfy_api/input in 0.33)
    local own=() host dir
    for host in "${HOSTS[@]}"; do
        for dir in models/*/* output/* input/* user/*; do own+=("--exclude=$host/$dir"); done
    done
    tar -C "$ROOT/.host" --exclude=__pycache__ --exclude='*/custom_nodes/reusekit' --exclude='*/tests' \
        --exclude='*/tests-unit' --exclude='*/blueprints' --exclude='*/.git' --exclude='*/.github' \
        --exclude='*/llama_tokenizer' --exclude='*/qwen*_tokenizer' "${own[@]}" \
        -cJf "$CARRY/hosts.tar.xz" "${HOSTS[@]}" || exit 1
    du -sh "$CARRY"/whl "$CARRY"/hosts.tar.xz; du -sh "$CARRY"
    local kb
    kb=$(du -sk "$CARRY" | cut -f1)
    if [ "$kb" -gt $((60 * 1024)) ]; then echo "gpu_check: .devcarry is over 60 MB" >&2; exit 1; fi
    echo "carry it: run(carry=[\".devcarry\"], command=\"bash scripts/gpu_check.sh\")"
}

run_checks() {
    local out=${OUT:-$ROOT/gpu-check-logs} site=/tmp/rk-site hosts=/tmp/rk-hosts status=0
    mkdir -p "$out" "$site" "$hosts"
    [ -d "$CARRY/whl" ] || { echo "gpu_check: no .devcarry here: run --prepare where there is an index, carry it" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$CARRY"/whl/*.whl >"$out/install.log" 2>&1 || { echo "gpu_check: wheel install failed" >&2; cat "$out/install.log"; exit 2; }
    tar -C "$hosts" -xJf "$CARRY/hosts.tar.xz" || exit 2
    export PYTHONPATH=$site PYTHONUNBUFFERED=1
    local pytest
    pytest=$(dirname "$(command -v python3)")/pytest
    [ -x "$pytest" ] || pytest="python3 -m pytest"
    nvidia-smi >>"$out/install.log" 2>&1  # one file with the install: the device tool brings back 8 files at most
    python3 -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))" \
        >"$out/summary.txt" 2>&1  # the machine's torch, not the project's: each run's figures name it
    local selected=("$@")
    [ ${#selected[@]} -gt 0 ] || selected=("${HOSTS[@]}")
    cd "$ROOT" || exit 2
    for host in "${selected[@]}"; do
        [ -d "$hosts/$host" ] || { echo "$host: not in the carry" >>"$out/summary.txt"; status=1; continue; }
        export COMFYUI_PATH=$hosts/$host REUSEKIT_TEST_CUDA=1
        timeout "${GPU_CHECK_TEST_S:-150}" $pytest -q -p no:cacheprovider -m gpu -rs tests >"$out/gpu-$host.log" 2>&1
        local rc=$?
        echo "$host gpu tests (rc $rc): $(grep -E '(passed|failed|error)' "$out/gpu-$host.log" | tail -1)" >>"$out/summary.txt"
        [ $rc -eq 0 ] || status=1
        timeout "${GPU_CHECK_BENCH_S:-90}" python3 bench/graph_reuse.py >"$out/bench-$host.log" 2>&1
        rc=$?
        echo "$host bench (rc $rc): $(grep '^RESULT' "$out/bench-$host.log" | tail -1)" >>"$out/summary.txt"
        [ $rc -eq 0 ] || status=1
        timeout "${GPU_CHECK_PE_S:-45}" python3 bench/pe_cache_gpu.py >"$out/pe-$host.log" 2>&1
        rc=$?
        echo "$host pe bench (rc $rc): $(grep '^RESULT' "$out/pe-$host.log" | tail -1)" >>"$out/summary.txt"
        [ $rc -eq 0 ] || status=1
    done
    cat "$out/summary.txt"
    return $status
}

dry_run() {
    local status=0 venv dir rc
    cd "$ROOT" || exit 2
    for host in 0.3.75 0.33; do
        IFS=$'\t' read -r venv dir < <(scripts/setup.sh --print-host "$host")
        [ -x "$venv/bin/python" ] || { echo "gpu_check --dry-run: no $venv"; status=1; continue; }
        COMFYUI_PATH=$dir timeout 300 "$venv/bin/python" bench/pe_cache_gpu.py --dry-run >/tmp/rk-pe-dry-$host.log 2>&1
        rc=$?
        echo "ComfyUI $host pe bench dry run (rc $rc): $(grep '^RESULT' /tmp/rk-pe-dry-$host.log | tail -1)"
        [ $rc -eq 0 ] || status=1
    done
    return $status
}

if [ "${1:-}" = "--prepare" ]; then
    prepare
elif [ "${1:-}" = "--dry-run" ]; then
    dry_run
else
    run_checks "$@"
fi
