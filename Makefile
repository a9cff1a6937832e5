# kvsim: `make run` sets up and runs the default scenario; `make test` sets up and runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# torch==2.13.0 resolves to the CPU build on these machines; the CPU replay backend needs it.
# ray: the sweep tests start a real local Ray head node (kvsim sweep --address).
EXTRAS := dev,cpu-ref,ray

.PHONY: run test lint vllm-env bench bench-sim bench-memory bench-fuzz bench-replay-host bench-cpu-replay bench-gpu setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -c "import sim.fast; sim.fast.warm()"  # compile the fast engine and the compiled checker once (numba cache)
	rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

# vLLM's real scheduler for `kvsim record --engine vllm`, in a virtualenv of its own (~2 GB)
# that never enters kvsim's install; the adapter is pinned to this vLLM (sim/engines/vllm.py).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat vllm-requirements.txt | sha1sum | cut -c1-12)

$(VLLM_STAMP): vllm-requirements.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm==0.33.0 xgrammar==0.2.8
	$(VLLM_VENV)/bin/pip install -q -r vllm-requirements.txt
	rm -f $(VLLM_VENV)/.installed-*; touch $@

vllm-env: $(VLLM_STAMP)

run: $(STAMP)
	$(BIN)/kvsim run scenarios/default.toml

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 -q tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# `make bench` runs every benchmark (bench/README.md); each writes bench/results/*.json.
# It takes about half an hour on 2 cores; the parts run alone too.
bench: bench-sim bench-memory bench-fuzz bench-replay-host bench-cpu-replay bench-gpu

# Side by side (fast vs reference engine) at 2,000 requests, then the targets at 10,000.
bench-sim: $(STAMP)
	$(BIN)/python bench/run.py --requests 2000 --workloads a --engines auto,reference --reps 1 \
		--out bench/results/sim_side_by_side_2k.json
	$(BIN)/python bench/run.py --requests 10000 --workloads a --reps 3 \
		--out bench/results/sim_a10k.json
	$(BIN)/python bench/run.py --requests 10000 --workloads b --reps 1 \
		--out bench/results/sim_b10k.json

bench-memory: $(STAMP)
	$(BIN)/python bench/memory.py --requests 1000000 --scenario bench/workloads/a_vidur.toml \
		--out bench/results/memory_1m.json

bench-fuzz: $(STAMP)
	$(BIN)/python bench/fuzz_ttf.py --out bench/results/fuzz_ttf.json

# The GPU replay's host work per step (the preparation), no GPU.
bench-replay-host: $(STAMP)
	$(BIN)/python bench/replay_host.py --json bench/results/replay_host.json

# The CPU reference replay of `make run`'s trace (what a user without a GPU waits for).
bench-cpu-replay: $(STAMP)
	$(BIN)/python bench/cpu_replay.py --json bench/results/cpu_replay.json

# On a CUDA host with the gpu extra (GPU_PY: a Python with torch + flashinfer); skipped here.
GPU_PY ?= $(BIN)/python
# batch x kv_len of the replay sweep (bench/gpu_replay.py --sweep): where the ratio stops being host-bound
GPU_SWEEP ?= 64x2048,64x8192,128x4096,128x8192,256x8192,128x16384
bench-gpu:
	@if $(GPU_PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; \
	then $(GPU_PY) tests/unit/replay_traces.py --big /tmp/kvsim-bench-gpu >/dev/null && \
		$(GPU_PY) bench/gpu_replay.py /tmp/kvsim-bench-gpu/big_verify \
			--json bench/results/gpu_replay.json && \
		$(GPU_PY) bench/gpu_replay.py --sweep $(GPU_SWEEP) --work /tmp/kvsim-bench-gpu \
			--json bench/results/gpu_replay_sweep.json; \
	else echo "bench-gpu: skipped, no CUDA device for $(GPU_PY) (bench/README.md: GPU host)"; fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
