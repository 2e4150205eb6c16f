# ReuseKit: `make run` starts ComfyUI with the pack loaded; `make test` runs the whole suite on both hosts.
# Both set everything up first (scripts/setup.sh; fast when already done).
PORT ?= 8188
HOST_DIR := $(or $(COMFYUI_PATH),$(CURDIR)/.host/ComfyUI)
PY := $(CURDIR)/.venv/bin/python

.PHONY: setup setup-test run test bench lint

setup:
	@scripts/setup.sh

setup-test:
	@scripts/setup.sh --test

run: setup
	@cpu=$$($(PY) -c 'import torch; print("" if torch.cuda.is_available() else "--cpu")'); \
	echo "ReuseKit: starting ComfyUI with the pack at http://127.0.0.1:$(PORT)$${cpu:+ (no GPU found: CPU mode)}"; \
	cd "$(HOST_DIR)" && exec $(PY) main.py $$cpu --listen 127.0.0.1 --port $(PORT) --disable-auto-launch

# Every host of the matrix (ComfyUI 0.3.75 and 0.33); REUSEKIT_HOST=0.33 picks one.
test:
	@scripts/test.sh $(PYTEST_ARGS)

lint: setup-test
	@.venv/bin/python -m pip install -q ruff && .venv/bin/ruff check .
