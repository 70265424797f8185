# vllm-overlay: the user interface. `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# The release every target uses unless VLLM= names another: the one line of patches/DEFAULT, read here
# and nowhere else in the Makefile (flipping the default is a one-line change of that file).
DEFAULT_VLLM := $(shell head -n 1 patches/DEFAULT)
VLLM ?= $(DEFAULT_VLLM)
VENV ?= .venv
TEST_JOBS ?= auto
PY := $(VENV)/bin/python
PYTHON ?= python3
# The tool's environment (.venv) runs on the default release's own torch: the `torch` field of its
# pin.toml (the wheel's Requires-Dist pin, which the build checks it against).
TORCH := $(shell sed -n 's/^torch *= *"\([0-9.]*\)".*/\1/p' patches/$(DEFAULT_VLLM)/pin.toml)
# Where `make build` installs: the tool's environment for the default release, an environment of its own
# (.venv-<release>, on that release's torch) for any other: one environment holds one release's torch.
INSTALL ?= $(if $(filter $(DEFAULT_VLLM),$(VLLM)),$(VENV),$(VENV)-$(VLLM))
TOOL_STAMP := $(VENV)/.overlay-tool
BUILD_STAMP := $(INSTALL)/.overlay-build-$(VLLM)
# q: a variable's value as one shell word ($(call q,TO)), so that no value a user gives (TO, REF,
# PROFILE, NAME, OUT, ...) ever becomes shell code; it takes the variable's name, so commas in the
# value are kept. qw: each whitespace-separated word of a list variable (RELEASES, TAGS, ARGS, ...)
# as its own shell word, each preceded by a space.
q = '$(subst ','\'',$($(1)))'
qw = $(if $($(1)), $(foreach w,$($(1)),$(call q,w)))
OVERLAY = $(call q,PY) -m overlay
# Which Python a target's verb runs under. $(OVERLAY), the venv's, for every verb that runs here:
# the target depends on $(TOOL_STAMP) (or $(BUILD_STAMP)), which makes the venv with the tool's
# dependencies. $(call q,PYTHON) -m overlay, a bare python3 with no venv and no stamp, only for the
# verbs that run on the GPU device machine, which has neither a venv nor a network: the one list is
# overlay/commands/__init__.py:DEVICE_VERBS (engine-check, engine-checkpoint, bench-engine), which
# says why scripts/device-*.sh may call other verbs there; overlay/commands/ imports only the
# standard library so they can. bench-merge runs under $(INSTALL)'s python (after $(BUILD_STAMP)): it
# times the build that environment imports, VLLM's own (.venv-<release> for another release). A new
# target is named as its verb (letters, digits, _ and -): `<verb>: $(TOOL_STAMP) ## help [VARS]`,
# then `$(OVERLAY) <verb>`, and the verb goes on a
# .PHONY line: every target `make help` lists is a command, never a file, and one named like a path
# that exists (dist, docs, kernel-sources) would otherwise be "up to date" and do nothing. Its README
# rows: the "Make targets" table (tests/test_readme.py) and, for a new commands module, the Layout row
# overlay/commands/ (tests/test_package_layout.py). tests/test_commands.py holds these rules.

# Release versions are checked as x.y.z before any recipe (or the stamp file named after VLLM) uses them.
is_version = $(shell printf '%s' $(call q,$(1)) | grep -Ex '[0-9]+\.[0-9]+\.[0-9]+((\.post|rc)[0-9]+)?')
ifneq ($(call is_version,VLLM),$(VLLM))
$(error VLLM=$(VLLM): not a release version like 0.30.0)
endif
ifneq ($(TO),)
ifneq ($(call is_version,TO),$(TO))
$(error TO=$(TO): not a release version like 0.30.0)
endif
endif

.PHONY: help build test lint status workspace export bench-build bench-merge image image-smoke rebase rebase-continue cherry-pick cherry-pick-continue

help: ## list every target
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(TOOL_STAMP): pyproject.toml patches/DEFAULT patches/$(DEFAULT_VLLM)/pin.toml | venv-python
	@test -n '$(TORCH)' || { echo "make: patches/$(DEFAULT_VLLM)/pin.toml has no torch = \"X.Y.Z\" (the release's torch pin)" >&2; exit 2; }
	@test -x $(call q,PY) || $(call q,PYTHON) -m venv $(call q,VENV)
	@echo "make: $(VENV) on torch $(TORCH), vLLM $(DEFAULT_VLLM)'s pin (a CUDA build from PyPI runs on the CPU too) ..." >&2
	$(call q,PY) -m pip install -q --disable-pip-version-check torch==$(TORCH)
	$(call q,PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $(call q,TOOL_STAMP)

# A venv whose python is a dangling link (its base Python removed or moved) cannot be repaired by
# `python -m venv` over it, and every target would end in "No such file or directory" (Error 127).
.PHONY: venv-python
venv-python:
	@py=$(call q,PY); venv=$(call q,VENV); \
	if { [ -L "$$py" ] && [ ! -e "$$py" ]; } || { [ -e "$$py" ] && ! "$$py" -c pass 2>/dev/null; }; then \
		echo "make: $$py -> $$(readlink "$$py") does not run (its Python is gone): remove $$venv (rm -rf $$venv) and run make again" >&2; exit 2; fi

build: $(TOOL_STAMP) ## build dist/vllm-<base>+<tag>-*.whl from the pinned wheel + series, install into .venv (another release: .venv-<release>) [VLLM=<patches/DEFAULT> INSTALL=]
	$(OVERLAY) build --vllm $(call q,VLLM) --install $(call q,INSTALL)
	@touch $(call q,BUILD_STAMP)

$(BUILD_STAMP): $(TOOL_STAMP) $(wildcard patches/$(VLLM)/*) $(wildcard overlay/*.py overlay/build/*.py)
	$(OVERLAY) build --vllm $(call q,VLLM) --install $(call q,INSTALL)
	@touch $(call q,BUILD_STAMP)

test: $(BUILD_STAMP) ## the CPU test suite but the long tests, on TEST_JOBS workers (lint included, then upstream-tests); .ci/run runs it, then test-long [TEST_JOBS=auto]
	$(call q,PY) -m ruff check overlay tests
	$(OVERLAY) patch-lint --vllm $(call q,VLLM)
	$(call q,PY) -m pytest -m "not gpu and not long" -n $(call q,TEST_JOBS) --dist loadgroup
	$(OVERLAY) upstream-tests --vllm $(call q,VLLM) --out $(if $(UPSTREAM_OUT),$(call q,UPSTREAM_OUT),upstream-tests)

.PHONY: test-long
test-long: $(BUILD_STAMP) ## the tests that run for minutes (make targets in fresh clones, the GLM-5 steps at DCP 4, the other carried releases' prefix proofs; marked long); .ci/run runs them after test
	$(call q,PY) -m pytest -m "long and not gpu"

.PHONY: upstream-tests
upstream-tests: $(BUILD_STAMP) ## vLLM's own tests of the touched modules (verified sdist) on the patched tree; exit 0 pass, else not [UPSTREAM_OUT=upstream-tests TIMEOUT=300]
	$(OVERLAY) upstream-tests --vllm $(call q,VLLM) --out $(if $(UPSTREAM_OUT),$(call q,UPSTREAM_OUT),upstream-tests)$(if $(TIMEOUT), --timeout $(call q,TIMEOUT))

lint: $(TOOL_STAMP) ## ruff on the tool, and patch-lint
	$(call q,PY) -m ruff check overlay tests
	$(OVERLAY) patch-lint --vllm $(call q,VLLM)

.PHONY: patch-lint
patch-lint: $(TOOL_STAMP) ## the lines the series adds, through the release's own ruff check + ruff format; exit 0 clean, 1 findings [VLLM=<patches/DEFAULT>]
	$(OVERLAY) patch-lint --vllm $(call q,VLLM)

status: $(TOOL_STAMP) ## each patch: subject, origin, kind, files, applies; per release and patch: rebased, on GLM-5's path, proven in an engine [VLLM=<patches/DEFAULT>]
	$(OVERLAY) status --vllm $(call q,VLLM)

workspace: $(TOOL_STAMP) ## git tree .work/<VLLM> of the base + one commit per patch, to edit patches
	$(OVERLAY) workspace --vllm $(call q,VLLM)

export: $(TOOL_STAMP) ## write .work/<VLLM>'s commits back to patches/<VLLM>/ (deterministic; refuses uncommitted edits) [ALLOW_DIRTY=1]
	$(OVERLAY) export --vllm $(call q,VLLM)$(if $(ALLOW_DIRTY), --allow-dirty)

bench-build: $(TOOL_STAMP) ## rebuild time from the cached wheel vs cp of that wheel; edit -> installed vs pip, as ratios
	$(OVERLAY) bench-build --vllm $(call q,VLLM)

bench-merge: $(BUILD_STAMP) ## GPUs: DCP merges per transport, merge-then-project vs W_UV first, over a token grid, in VLLM's environment [OUT=bench-merge PLOT=merge.json RANKS=2 TP=8 MAX_NUM_SEQS= PARALLEL_CONFIG="field=value ..." BOUNDS=decode PROFILE_EAGER="16 768"]
	$(call q,INSTALL)/bin/python -m overlay bench-merge --vllm $(call q,VLLM)$(if $(OUT), --out $(call q,OUT))$(if $(PLOT), --plot $(call q,PLOT))$(if $(RANKS), --ranks $(call q,RANKS))$(if $(TP), --tp $(call q,TP))$(if $(MAX_NUM_SEQS), --max-num-seqs $(call q,MAX_NUM_SEQS))$(foreach f,$(PARALLEL_CONFIG), --parallel-config $(call q,f))$(if $(BOUNDS), --bounds $(call q,BOUNDS))$(if $(PROFILE_EAGER), --profile-eager$(call qw,PROFILE_EAGER))

image: $(TOOL_STAMP) ## image over vllm/vllm-openai with docker, podman or buildah (first usable; kernels rebuilt only for kernel patches) [DRY_RUN=1 ENGINE= SANDBOX=auto IMAGE= TAGS= ARCH=9.0a BASE_DIGEST= PUSH=1]
	$(OVERLAY) image --vllm $(call q,VLLM)$(if $(DRY_RUN), --dry-run)$(if $(ENGINE), --engine $(call q,ENGINE))$(if $(SANDBOX), --sandbox $(call q,SANDBOX))$(if $(IMAGE), --image $(call q,IMAGE))$(foreach t,$(TAGS), --tag $(call q,t))$(if $(ARCH), --arch $(call q,ARCH))$(if $(MAX_JOBS), --max-jobs $(call q,MAX_JOBS))$(if $(NVCC_THREADS), --nvcc-threads $(call q,NVCC_THREADS))$(if $(BASE_DIGEST), --base-digest $(call q,BASE_DIGEST))$(if $(PUSH), --push)

image-smoke: $(TOOL_STAMP) ## our image built on a CPU stand-in of the base (Debian + PyPI), run and checked; NEGATIVE= must fail [ENGINE= SANDBOX=auto NEGATIVE=version|patch KEEP=1 TORCH=<wheel>]
	$(OVERLAY) image-smoke --vllm $(call q,VLLM)$(if $(ENGINE), --engine $(call q,ENGINE))$(if $(SANDBOX), --sandbox $(call q,SANDBOX))$(if $(NEGATIVE), --negative $(call q,NEGATIVE))$(if $(KEEP), --keep)$(if $(TORCH), --torch $(call q,TORCH))

.PHONY: kernel-sources kernel-toolchain kernels
KERNEL_PATCHES = $(if $(PATCHES),$(call q,PATCHES),patches)
kernel-sources: $(TOOL_STAMP) ## kernel-sources/<VLLM>/: each FetchContent source at its pin (placeholders for what TARGETS do not compile), offline builds [TARGETS= MIRROR= REMOTES="name=repo" EXCLUDE="name=path" CHECK=1]
	$(OVERLAY) kernel-sources --vllm $(call q,VLLM)$(if $(TARGETS), --targets$(call qw,TARGETS))$(if $(MIRROR), --mirror $(call q,MIRROR))$(foreach r,$(REMOTES), --remote $(call q,r))$(foreach e,$(EXCLUDE), --exclude $(call q,e))$(if $(CHECK), --check)

kernel-toolchain: $(TOOL_STAMP) ## check the kernel build's cmake, CUDA torch config and CUDA libraries; ASSEMBLE=1 makes them from PyPI [ASSEMBLE=1]
	PATH="$(abspath $(VENV))/bin:$$PATH" $(OVERLAY) kernel-toolchain$(if $(ASSEMBLE), --assemble)

kernels: $(TOOL_STAMP) ## rebuild the CUDA targets the series' kernel patches touch (scripts/build-kernels.sh) into KERNELS_OUT, then the wheel with them [PATCHES=patches KERNELS_OUT=kernels/<VLLM> MAX_JOBS=]
	$(OVERLAY) --patches $(KERNEL_PATCHES) kernels build --vllm $(call q,VLLM) --out $(if $(KERNELS_OUT),$(call q,KERNELS_OUT),kernels/$(VLLM))

rebase: $(TOOL_STAMP) ## carry the series onto release TO: every patch classified in one run; patches/<TO>/ with REBASE.md, or exit 2 with the report in .work/rebase-<TO>/ [TO=x.y.z NO_TESTS=1]
	@test -n $(call q,TO) || { echo "usage: make rebase TO=x.y.z" >&2; exit 1; }
	$(OVERLAY) rebase --vllm $(call q,VLLM) --to $(call q,TO)$(if $(NO_TESTS), --no-tests)

.PHONY: patch-tests-matrix
patch-tests-matrix: $(BUILD_STAMP) ## every patch's tests on every release, without and with it: OUT/matrix.md; exit 0 green or explained, 1 a red cell [RELEASES="x.y.z ..." (default: every pinned release newer than VLLM) OUT=patch-tests-matrix]
	$(OVERLAY) patch-tests-matrix --vllm $(call q,VLLM)$(if $(RELEASES), --releases$(call qw,RELEASES)) --out $(if $(OUT),$(call q,OUT),patch-tests-matrix)

rebase-continue: $(TOOL_STAMP) ## go on with a rebase that set patches aside, once the current one is resolved with git in .work/rebase-<TO>/; LEFT_OUT=1 WHY="..." leaves it out of the series [TO= NO_TESTS=1 LEFT_OUT=1 WHY=]
	$(OVERLAY) rebase-continue$(if $(TO), --to $(call q,TO))$(if $(NO_TESTS), --no-tests)$(if $(LEFT_OUT), --left-out)$(if $(WHY), --why $(call q,WHY))

cherry-pick: $(TOOL_STAMP) ## add an upstream change to the series [REF=<PR number|commit|patch file> AFTER= BEFORE= NAME= ORIGIN= VLLM_REMOTE=]
	@test -n $(call q,REF) || { echo "usage: make cherry-pick REF=<PR number|commit|patch file>" >&2; exit 1; }
	$(OVERLAY) cherry-pick --vllm $(call q,VLLM)$(if $(AFTER), --after $(call q,AFTER))$(if $(BEFORE), --before $(call q,BEFORE))$(if $(NAME), --name $(call q,NAME))$(if $(ORIGIN), --origin $(call q,ORIGIN)) -- $(call q,REF)

cherry-pick-continue: $(TOOL_STAMP) ## finish a cherry-pick stopped at a conflict, once resolved in .work/cherry-pick-<VLLM>/
	$(OVERLAY) cherry-pick --vllm $(call q,VLLM) --continue

.PHONY: regress
# make exits 2 whenever a recipe fails, so its status says only pass (0) or not (2); OUT/verdict
# (one word: pass, regression, harness) and OUT/verdict.json say which. scripts/regress.sh returns 0/1/2.
REGRESS_OUT = $(or $(OUT),regress-report)
regress: $(TOOL_STAMP) ## differential vs a reference, long context, GSM8K, latency, acceptance vs baselines; exit 0 pass, 2 not; OUT/verdict: pass/regression/harness [PROFILE= BASE_URL= REF_URL= OUT= ARGS= ATTACH_TIMEOUT=]
	@out=$(call q,REGRESS_OUT); rm -f "$$out/verdict" "$$out/verdict.json"; \
	$(if $(ATTACH_TIMEOUT),REGRESS_ATTACH_TIMEOUT=$(call q,ATTACH_TIMEOUT) )$(OVERLAY) regress --profile $(if $(PROFILE),$(call q,PROFILE),glm5.2-fp8-tp8-dcp8) --out "$$out"$(if $(BASE_URL), --base-url $(call q,BASE_URL))$(if $(REF_URL), --ref-url $(call q,REF_URL))$(call qw,ARGS) || { rc=$$?; echo "make regress: verdict $$(cat "$$out/verdict" 2>/dev/null || echo harness) (overlay regress exit $$rc); details in $$out/verdict.json" >&2; exit $$rc; }

.PHONY: engine-check engine-variants engine-checkpoint engine-plot regress-verdicts liveness-lines
engine-check: ## GPUs: real vLLM engine, tiny GLM-5 checkpoint, every DCP case vs DCP 1; VLLM= given: the installed build must be that release; COVERAGE=1: patch liveness per case [OUT=engine-check TP=2 CASES= TIMEOUT=420 PARALLEL=1 VARIANTS= VARIANT= EXPECT= VLLM= COVERAGE= LIVENESS=]
	$(call q,PYTHON) -m overlay engine-check --out $(if $(OUT),$(call q,OUT),engine-check) --tp $(if $(TP),$(call q,TP),2)$(if $(CASES), --cases $(call q,CASES))$(if $(TIMEOUT), --timeout $(call q,TIMEOUT))$(if $(PARALLEL), --parallel $(call q,PARALLEL))$(if $(VARIANTS), --variants $(call q,VARIANTS))$(if $(VARIANT), --variant $(call q,VARIANT))$(if $(EXPECT), --expect $(call q,EXPECT))$(if $(filter command line environment,$(origin VLLM)), --vllm $(call q,VLLM))$(if $(COVERAGE), --coverage)$(if $(LIVENESS), --liveness $(call q,LIVENESS))

.PHONY: bench-engine
bench-engine: ## GPUs: vllm serve of the tiny GLM-5 (TP2 x DCP2), projection before the DCP merge on vs off (each server told its build's way) plus a twin of on (the null), judged per cell with an interval and verdict [OUT=bench-engine BATCHES=1,8,64 CONTEXTS=4096,16384,65536 CELLS= REPEATS=5 CELL_SECONDS=10 DECODE=128 TRANSPORT=direct BUDGET= PLOT=engine.json REANALYZE=engine.json ARGS=]
	$(call q,PYTHON) -m overlay bench-engine --out $(if $(OUT),$(call q,OUT),bench-engine)$(if $(BATCHES), --batches $(call q,BATCHES))$(if $(CONTEXTS), --contexts $(call q,CONTEXTS))$(if $(CELLS), --cells $(call q,CELLS))$(if $(REPEATS), --repeats $(call q,REPEATS))$(if $(CELL_SECONDS), --cell-seconds $(call q,CELL_SECONDS))$(if $(DECODE), --decode-tokens $(call q,DECODE))$(if $(TRANSPORT), --transport $(call q,TRANSPORT))$(if $(BUDGET), --budget $(call q,BUDGET))$(if $(PLOT), --plot $(call q,PLOT))$(if $(REANALYZE), --reanalyze $(call q,REANALYZE))$(call qw,ARGS)

engine-variants: $(TOOL_STAMP) ## the seed-bug variant trees (series minus each fix, stock) for engine-check [OUT=.device/variants]
	$(OVERLAY) engine-variants --vllm $(call q,VLLM) --out $(if $(OUT),$(call q,OUT),.device/variants)

engine-checkpoint: ## the tiny GLM-5 checkpoint engine-check and bench-engine serve (deterministic), or GLM-5's per-rank config [OUT= ARGS=--glm5-per-rank]
	$(call q,PYTHON) -m overlay engine-checkpoint$(if $(OUT), --out $(call q,OUT))$(call qw,ARGS)

engine-plot: $(TOOL_STAMP) ## one PNG of engine-check results side by side [RESULTS="a/results.json b/results.json" OUT=engine.png]
	@test -n $(call q,RESULTS) || { echo "usage: make engine-plot RESULTS='DIR/results.json ...' [OUT=engine.png]" >&2; exit 1; }
	$(OVERLAY) engine-plot$(call qw,RESULTS) --out $(if $(OUT),$(call q,OUT),engine.png)

liveness-lines: $(TOOL_STAMP) ## the lines each patch of the series adds, as JSON: engine-check COVERAGE=1's LIVENESS= file [OUT=.device/liveness.json]
	$(OVERLAY) liveness-lines --vllm $(call q,VLLM) --out $(if $(OUT),$(call q,OUT),.device/liveness.json)

regress-verdicts: $(TOOL_STAMP) ## did each regress run under ROOT reach its expected verdict? [ROOT=runs EXPECT="full=pass minus-x=regression:differential"]
	@test -n $(call q,ROOT) -a -n $(call q,EXPECT) || { echo "usage: make regress-verdicts ROOT=DIR EXPECT='NAME=pass NAME=regression:CHECK ...'" >&2; exit 1; }
	$(OVERLAY) regress-verdicts -- $(call q,ROOT)$(call qw,EXPECT)

.PHONY: workspace-plan
workspace-plan: $(TOOL_STAMP) ## direct DCP q-gather/A2A workspace capacity and bytes, and the gathered W_UV, per GPU [PROFILE= ARGS=]
	$(OVERLAY) workspace-plan$(if $(PROFILE), --profile $(call q,PROFILE))$(call qw,ARGS)

.PHONY: device-stage
device-stage: $(BUILD_STAMP) ## GPU device machine: built wheel's tree, kernels, missing wheels in .device/<NAME>/carry-NN (<= 60 MiB each) [NAME=engine EXTRA='lm-eval[api]==0.4.13 ...']
	$(OVERLAY) device-stage --vllm $(call q,VLLM) --name $(if $(NAME),$(call q,NAME),engine)$(foreach e,$(EXTRA), --extra $(call q,e))
