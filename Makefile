# vllm-overlay: the user interface. `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VLLM ?= $(shell head -n 1 patches/DEFAULT)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
TOOL_STAMP := $(VENV)/.overlay-tool
BUILD_STAMP := $(VENV)/.overlay-build-$(VLLM)
OVERLAY := $(PY) -m overlay

.PHONY: help build test lint status workspace export bench-build bench-merge image image-smoke rebase rebase-continue cherry-pick cherry-pick-continue

help: ## list every target
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(TOOL_STAMP): pyproject.toml | venv-python
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $@

# A venv whose python is a dangling link (its base Python removed or moved) cannot be repaired by
# `python -m venv` over it, and every target would end in "No such file or directory" (Error 127).
.PHONY: venv-python
venv-python:
	@if { [ -L $(PY) ] && [ ! -e $(PY) ]; } || { [ -e $(PY) ] && ! $(PY) -c pass 2>/dev/null; }; then \
		echo "make: $(PY) -> $$(readlink $(PY)) does not run (its Python is gone): remove $(VENV) (rm -rf $(VENV)) and run make again" >&2; exit 2; fi

build: $(TOOL_STAMP) ## build dist/vllm-<base>+<tag>-*.whl from the pinned wheel + series, install into .venv [VLLM=0.28.0]
	$(OVERLAY) build --vllm $(VLLM) --install $(VENV)
	@touch $(BUILD_STAMP)

$(BUILD_STAMP): $(TOOL_STAMP) $(wildcard patches/$(VLLM)/*) $(wildcard overlay/*.py overlay/build/*.py)
	$(OVERLAY) build --vllm $(VLLM) --install $(VENV)
	@touch $@

test: $(BUILD_STAMP) ## the whole CPU test suite (lint included, then upstream-tests); what .ci/run calls
	$(PY) -m ruff check overlay tests
	$(OVERLAY) patch-lint --vllm $(VLLM)
	$(PY) -m pytest -m "not gpu"
	$(OVERLAY) upstream-tests --vllm $(VLLM) --out $(or $(UPSTREAM_OUT),upstream-tests)

.PHONY: upstream-tests
upstream-tests: $(BUILD_STAMP) ## vLLM's own tests of the touched modules (verified sdist) on the patched tree; exit 0 pass, else not [UPSTREAM_OUT=upstream-tests TIMEOUT=300]
	$(OVERLAY) upstream-tests --vllm $(VLLM) --out $(or $(UPSTREAM_OUT),upstream-tests)$(if $(TIMEOUT), --timeout $(TIMEOUT))

lint: $(TOOL_STAMP) ## ruff on the tool, and patch-lint
	$(PY) -m ruff check overlay tests
	$(OVERLAY) patch-lint --vllm $(VLLM)

.PHONY: patch-lint
patch-lint: $(TOOL_STAMP) ## the lines the series adds, through the release's own ruff check + ruff format; exit 0 clean, 1 findings [VLLM=0.28.0]
	$(OVERLAY) patch-lint --vllm $(VLLM)

status: $(TOOL_STAMP) ## each patch: subject, origin, kind, files, applies [VLLM=0.28.0]
	$(OVERLAY) status --vllm $(VLLM)

workspace: $(TOOL_STAMP) ## git tree .work/<VLLM> of the base + one commit per patch, to edit patches
	$(OVERLAY) workspace --vllm $(VLLM)

export: $(TOOL_STAMP) ## write .work/<VLLM>'s commits back to patches/<VLLM>/ (deterministic; refuses uncommitted edits) [ALLOW_DIRTY=1]
	$(OVERLAY) export --vllm $(VLLM)$(if $(ALLOW_DIRTY), --allow-dirty)

bench-build: $(TOOL_STAMP) ## rebuild time from the cached wheel vs cp of that wheel; edit -> installed vs pip, as ratios
	$(OVERLAY) bench-build --vllm $(VLLM)

bench-merge: $(TOOL_STAMP) ## GPUs: DCP merge + W_UV projection, baseline vs project-first, per transport [OUT=bench-merge PLOT=merge.json RANKS=2 BOUNDS=decode PROFILE_EAGER="16 768"]
	$(OVERLAY) bench-merge --vllm $(VLLM)$(if $(OUT), --out $(OUT))$(if $(PLOT), --plot $(PLOT))$(if $(RANKS), --ranks $(RANKS))$(if $(BOUNDS), --bounds $(BOUNDS))$(if $(PROFILE_EAGER), --profile-eager $(PROFILE_EAGER))

image: $(TOOL_STAMP) ## image over vllm/vllm-openai with docker, podman or buildah (first usable; kernels rebuilt only for kernel patches) [DRY_RUN=1 ENGINE= SANDBOX=auto IMAGE= TAGS= ARCH=9.0a BASE_DIGEST= PUSH=1]
	$(OVERLAY) image --vllm $(VLLM)$(if $(DRY_RUN), --dry-run)$(if $(ENGINE), --engine $(ENGINE))$(if $(SANDBOX), --sandbox $(SANDBOX))$(if $(IMAGE), --image $(IMAGE))$(foreach t,$(TAGS), --tag $(t))$(if $(ARCH), --arch '$(ARCH)')$(if $(MAX_JOBS), --max-jobs $(MAX_JOBS))$(if $(NVCC_THREADS), --nvcc-threads $(NVCC_THREADS))$(if $(BASE_DIGEST), --base-digest $(BASE_DIGEST))$(if $(PUSH), --push)

image-smoke: $(TOOL_STAMP) ## our image built on a CPU stand-in of the base (Debian + PyPI), run and checked; NEGATIVE= must fail [ENGINE= SANDBOX=auto NEGATIVE=version|patch KEEP=1 TORCH=<wheel>]
	$(OVERLAY) image-smoke --vllm $(VLLM)$(if $(ENGINE), --engine $(ENGINE))$(if $(SANDBOX), --sandbox $(SANDBOX))$(if $(NEGATIVE), --negative $(NEGATIVE))$(if $(KEEP), --keep)$(if $(TORCH), --torch '$(TORCH)')

rebase: $(TOOL_STAMP) ## carry the series onto release TO: every patch classified in one run; patches/<TO>/ with REBASE.md, or exit 2 with the report in .work/rebase-<TO>/ [TO=x.y.z NO_TESTS=1]
	@test -n "$(TO)" || { echo "usage: make rebase TO=x.y.z" >&2; exit 1; }
	$(OVERLAY) rebase --vllm $(VLLM) --to $(TO)$(if $(NO_TESTS), --no-tests)

.PHONY: patch-tests-matrix
MATRIX_RELEASES ?= 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0
patch-tests-matrix: $(BUILD_STAMP) ## every patch's tests on every release, without and with it: OUT/matrix.md; exit 0 green or explained, 1 a red cell [RELEASES="0.29.0 ... 0.33.0" OUT=patch-tests-matrix]
	$(OVERLAY) patch-tests-matrix --vllm $(VLLM) --releases $(or $(RELEASES),$(MATRIX_RELEASES)) --out $(or $(OUT),patch-tests-matrix)

rebase-continue: $(TOOL_STAMP) ## go on with a rebase that set patches aside, once the current one is resolved with git in .work/rebase-<TO>/
	$(OVERLAY) rebase-continue$(if $(TO), --to $(TO))$(if $(NO_TESTS), --no-tests)

cherry-pick: $(TOOL_STAMP) ## add an upstream change to the series [REF=<PR number|commit|patch file> AFTER= BEFORE= NAME= ORIGIN= VLLM_REMOTE=]
	@test -n "$(REF)" || { echo "usage: make cherry-pick REF=<PR number|commit|patch file>" >&2; exit 1; }
	$(OVERLAY) cherry-pick --vllm $(VLLM) '$(REF)'$(if $(AFTER), --after $(AFTER))$(if $(BEFORE), --before $(BEFORE))$(if $(NAME), --name $(NAME))$(if $(ORIGIN), --origin '$(ORIGIN)')

cherry-pick-continue: $(TOOL_STAMP) ## finish a cherry-pick stopped at a conflict, once resolved in .work/cherry-pick-<VLLM>/
	$(OVERLAY) cherry-pick --vllm $(VLLM) --continue

.PHONY: regress
# make exits 2 whenever a recipe fails, so its status says only pass (0) or not (2); OUT/verdict
# (one word: pass, regression, harness) and OUT/verdict.json say which. scripts/regress.sh returns 0/1/2.
REGRESS_OUT = $(or $(OUT),regress-report)
regress: $(TOOL_STAMP) ## differential vs a reference, long context, GSM8K, acceptance, latency vs baselines; exit 0 pass, 2 not; OUT/verdict: pass/regression/harness [PROFILE= BASE_URL= REF_URL= OUT= ARGS= ATTACH_TIMEOUT=]
	@rm -f $(REGRESS_OUT)/verdict $(REGRESS_OUT)/verdict.json
	@$(if $(ATTACH_TIMEOUT),REGRESS_ATTACH_TIMEOUT=$(ATTACH_TIMEOUT) )$(OVERLAY) regress --profile $(or $(PROFILE),glm5.2-fp8-tp8-dcp8) --out $(REGRESS_OUT)$(if $(BASE_URL), --base-url $(BASE_URL))$(if $(REF_URL), --ref-url $(REF_URL)) $(ARGS) || { rc=$$?; echo "make regress: verdict $$(cat $(REGRESS_OUT)/verdict 2>/dev/null || echo harness) (overlay regress exit $$rc); details in $(REGRESS_OUT)/verdict.json" >&2; exit $$rc; }

.PHONY: engine-check engine-variants engine-checkpoint engine-plot regress-verdicts
engine-check: ## GPUs: real vLLM engine, tiny GLM-5 checkpoint, every DCP case vs DCP 1 [OUT=engine-check TP=2 CASES= TIMEOUT=420 PARALLEL=1 VARIANTS= VARIANT= EXPECT=]
	$(PYTHON) -m overlay engine-check --out $(or $(OUT),engine-check) --tp $(or $(TP),2)$(if $(CASES), --cases $(CASES))$(if $(TIMEOUT), --timeout $(TIMEOUT))$(if $(PARALLEL), --parallel $(PARALLEL))$(if $(VARIANTS), --variants $(VARIANTS))$(if $(VARIANT), --variant $(VARIANT))$(if $(EXPECT), --expect '$(EXPECT)')

.PHONY: bench-engine
bench-engine: ## GPUs: vllm serve of the tiny GLM-5 (TP2 x DCP2), VLLM_DCP_PROJECT_BEFORE_MERGE 1 vs 0 plus a twin of 1 (the null), judged per cell with an interval and verdict [OUT=bench-engine BATCHES=1,8,64 CONTEXTS=4096,16384,65536 CELLS= REPEATS=5 CELL_SECONDS=10 DECODE=128 TRANSPORT=direct BUDGET= PLOT=engine.json REANALYZE=engine.json ARGS=]
	$(PYTHON) -m overlay bench-engine --out $(or $(OUT),bench-engine)$(if $(BATCHES), --batches $(BATCHES))$(if $(CONTEXTS), --contexts $(CONTEXTS))$(if $(CELLS), --cells $(CELLS))$(if $(REPEATS), --repeats $(REPEATS))$(if $(CELL_SECONDS), --cell-seconds $(CELL_SECONDS))$(if $(DECODE), --decode-tokens $(DECODE))$(if $(TRANSPORT), --transport $(TRANSPORT))$(if $(BUDGET), --budget $(BUDGET))$(if $(PLOT), --plot $(PLOT))$(if $(REANALYZE), --reanalyze $(REANALYZE)) $(ARGS)

engine-variants: $(TOOL_STAMP) ## the seed-bug variant trees (series minus each fix, stock) for engine-check [OUT=.device/variants]
	$(OVERLAY) engine-variants --vllm $(VLLM) --out $(or $(OUT),.device/variants)

engine-checkpoint: ## the tiny GLM-5 checkpoint engine-check and bench-engine serve (deterministic), or GLM-5's per-rank config [OUT= ARGS=--glm5-per-rank]
	$(PYTHON) -m overlay engine-checkpoint$(if $(OUT), --out $(OUT)) $(ARGS)

engine-plot: $(TOOL_STAMP) ## one PNG of engine-check results side by side [RESULTS="a/results.json b/results.json" OUT=engine.png]
	@test -n "$(RESULTS)" || { echo "usage: make engine-plot RESULTS='DIR/results.json ...' [OUT=engine.png]" >&2; exit 1; }
	$(OVERLAY) engine-plot $(RESULTS) --out $(or $(OUT),engine.png)

regress-verdicts: $(TOOL_STAMP) ## did each regress run under ROOT reach its expected verdict? [ROOT=runs EXPECT="full=pass minus-x=regression:differential"]
	@test -n "$(ROOT)" -a -n "$(EXPECT)" || { echo "usage: make regress-verdicts ROOT=DIR EXPECT='NAME=pass NAME=regression:CHECK ...'" >&2; exit 1; }
	$(OVERLAY) regress-verdicts $(ROOT) $(EXPECT)

.PHONY: workspace-plan
workspace-plan: $(TOOL_STAMP) ## direct DCP q-gather/A2A workspace capacity and bytes per GPU, both sizing modes [PROFILE= ARGS=]
	$(OVERLAY) workspace-plan$(if $(PROFILE), --profile $(PROFILE)) $(ARGS)

.PHONY: device-stage
device-stage: $(BUILD_STAMP) ## GPU device machine: built wheel's tree, kernels, missing wheels in .device/<NAME>/carry-NN (<= 60 MiB each) [NAME=engine EXTRA='lm-eval[api]==0.4.13 ...']
	$(OVERLAY) device-stage --vllm $(VLLM) --name $(or $(NAME),engine)$(foreach e,$(EXTRA), --extra '$(e)')
