# ReuseKit: `make run` starts ComfyUI with the pack loaded; `make test` runs the whole suite on both hosts.
# Both set everything up first (scripts/setup.sh; fast when already done).
SHELL := /bin/bash
PORT ?= 8188
# `make run` starts the bundled ComfyUI 0.3.75; REUSEKIT_HOST=0.33 starts the current host instead
RUN_HOST := $(or $(REUSEKIT_HOST),0.3.75)

.PHONY: setup setup-test run demo test bench lint

setup:
	@scripts/setup.sh --host $(RUN_HOST)

setup-test:
	@scripts/setup.sh --test --host $(RUN_HOST)

run: setup
	@IFS=$$'\t' read -r venv dir < <(scripts/setup.sh --print-host $(RUN_HOST)); \
	cpu=$$("$$venv/bin/python" -c 'import torch; print("" if torch.cuda.is_available() else "--cpu")'); \
	echo "ReuseKit: starting ComfyUI ($$dir) with the pack at http://127.0.0.1:$(PORT)$${cpu:+ (no GPU found: CPU mode)}"; \
	cd "$$dir" && exec "$$venv/bin/python" main.py $$cpu --listen 127.0.0.1 --port $(PORT) --disable-auto-launch

# The no-download demo on a headless server, with and without ReuseKit: a table per layer and the pictures
demo: setup
	@IFS=$$'\t' read -r venv dir < <(scripts/setup.sh --print-host $(RUN_HOST)); \
	COMFYUI_PATH="$$dir" "$$venv/bin/python" scripts/demo.py

# Every host of the matrix (ComfyUI 0.3.75 and 0.33); REUSEKIT_HOST=0.33 picks one.
test:
	@scripts/test.sh $(PYTEST_ARGS)

lint: setup-test
	@.venv/bin/ruff check .
