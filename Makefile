# Set-up and checks. Each target creates .venv on first use; `constraints.txt` pins the torch the
# suite is tested against, so a CPU machine installs the local CPU wheel instead of a CUDA build.
# `make demo` installs what the demo needs (the `demo` extra: torch, accel's own dependencies and
# matplotlib); `make test` and the other checks add the `dev` extra (the test stack, every
# integration, the linters) into the same .venv and build DeepSpeed's CPU op once.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST ?= $(PY) -m pytest
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# The editable install links each of the package's files (pyproject.toml says why): a stamp named
# by the list of those files makes `make` link again when a module is added or removed.
LINKS  := $(VENV)/.links-$(shell find accel accel_cli accel_settings -name '*.py' -o -name py.typed | sort | cksum | cut -d' ' -f1)

# NO_INSTALL=1 runs a target with .venv as it is, never installing into it (tests of the targets).
NO_INSTALL ?=
INSTALLED      := $(if $(NO_INSTALL),,$(STAMP) $(LINKS))
INSTALLED_DEMO := $(if $(NO_INSTALL),,$(DEMO_STAMP) $(LINKS))

.PHONY: demo test test-fast flake lint typecheck bench clean dist gpu-check deepspeed-ops cluster-engines

define venv
	test -x $(PY) || python3 -m venv $(VENV)
	@# The distribution was named `accel` before it became `accel-train`: drop an old install.
	$(PY) -m pip uninstall --quiet --yes accel 2>/dev/null || true
endef

$(DEMO_STAMP): pyproject.toml constraints.txt
	$(venv)
	$(PIP_INSTALL) -e '.[demo]'
	rm -f $(VENV)/.links-* && touch $(LINKS) $(DEMO_STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(venv)
	$(PIP_INSTALL) -e '.[dev]'
	$(MAKE) --no-print-directory deepspeed-ops
	rm -f $(VENV)/.links-* && touch $(LINKS) $(DEMO_STAMP) $(STAMP)

$(LINKS): | $(DEMO_STAMP)
	$(PIP_INSTALL) --no-deps -e .
	rm -f $(VENV)/.links-* && touch $(LINKS)

# DeepSpeed compiles a C++ op the first time an engine starts on a CPU (minutes on 2 cores);
# build it once here, into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so no test
# pays it. One build at a time (a file lock); a lock left by a killed build is removed.
deepspeed-ops:
	$(PY) -c "import accel; print(f'DeepSpeed ops ready ({accel.build_deepspeed_ops(remove_stale_lock=True):.0f} s)')"

demo: $(INSTALLED_DEMO)
	$(VENV)/bin/accel launch --num_processes 2 --gradient_accumulation_steps 2 examples/char_lm.py --out runs/demo

# A failed run ends with its failed tests' names and the last lines of each (their error, then
# what they printed), read from pytest's JUnit report ($(REPORT), which keeps the output of
# failed tests only): a failure is read at the end of the log, not searched for in it.
REPORT ?= .test-report.xml
REPORTED := --junitxml=$(REPORT) -o junit_logging=all -o junit_log_passing_tests=false
define failed_tests
{ rc=$$?; $(PY) tools/failures.py $(REPORT); exit $$rc; }
endef

# The cluster engines the suite drives for real (tests/slurm_cluster.py's SLURM daemons, Open
# MPI's mpirun): Debian's packages, installed with apt where it is available and this is root
# (CI: a fresh Debian machine); elsewhere it says so, and the tests that need them are skipped
# with the reason.
CLUSTER_PACKAGES := slurm-wlm munge openmpi-bin
CLUSTER_ENGINES  := $(if $(NO_INSTALL),,cluster-engines)
cluster-engines:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v mpirun >/dev/null; then \
		:; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q $(CLUSTER_PACKAGES) >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && apt-get install -y -q $(CLUSTER_PACKAGES) >/dev/null; }; \
	else \
		echo "cluster-engines: apt-get as root is not available: the SLURM and mpirun tests are skipped (install $(CLUSTER_PACKAGES))"; \
	fi

# The whole suite. pytest's exit code 5 (no test collected) fails the target like any other
# non-zero code: an empty run never passes. The slowest tests are listed so the suite's time
# (CI's budget is 25 minutes) is watched where it goes.
test: $(INSTALLED) $(CLUSTER_ENGINES)
	rm -f $(REPORT)
	$(PYTEST) -q --durations=25 $(REPORTED) || $(failed_tests)

# Everything but the tests marked `slow` (processes, subprocesses, seconds each): under 2 minutes
# on a loaded 2-core machine. `make test` (and CI) still runs the whole suite.
test-fast: $(INSTALLED)
	rm -f $(REPORT)
	$(PYTEST) -q -m "not slow" $(REPORTED) || $(failed_tests)

# Hunt an intermittent failure: run TESTS (pytest node ids) N times, each run a fresh pytest,
# alone (LOAD=none), beside a second pytest running the suite's process-starting tests
# (LOAD=slow) or beside one busy process per CPU (LOAD=burn). Every failed run's output stays in
# FLAKE_OUT, with the native stacks of any crash when CORES=1; the end lists each failure with
# its last lines. docs/testing.md.
TESTS     ?=
N         ?= 50
LOAD      ?= none
FLAKE_OUT ?= flake-out
CORES     ?=
flake: $(INSTALLED)
	@test -n "$(TESTS)" || { echo "make flake: TESTS is empty; e.g. make flake TESTS='tests/x.py::test_y' N=50 LOAD=slow" >&2; exit 2; }
	$(PY) tools/flake.py --runs $(N) --load $(LOAD) --out $(FLAKE_OUT) $(if $(CORES),--cores) $(TESTS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(INSTALLED)
	$(VENV)/bin/mypy accel accel_cli accel_settings

# The GPU check runs with the machine's own python and packages (no venv, no download):
# `make gpu-check` on a machine with a CUDA GPU (every part within 6 minutes), `make gpu-check
# DRY_RUN=1` on a CPU (CI). summary.json, logs and the benchmark's figures go to $(OUT);
# GPU_CHECK_ARGS passes more flags (`--only fp8` reruns the parts so named). docs/testing.md.
PYTHON  ?= python3
OUT     ?= gpu-check-out
DRY_RUN ?=
GPU_CHECK_ARGS ?=

gpu-check:
	PYTHONPATH=. $(PYTHON) tools/gpu_check.py --out "$(OUT)" $(if $(DRY_RUN),--dry-run) $(GPU_CHECK_ARGS)

# The sdist and the wheel a user can install without a checkout (docs/releasing.md), into dist/;
# needs only the `build` package (installed into .venv if missing), not torch.
# BUILD_FLAGS=--no-isolation builds with the venv's setuptools instead of a fresh one (offline).
BUILD_FLAGS ?=
dist:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m build --version >/dev/null 2>&1 || $(PY) -m pip install --quiet build
	rm -rf dist
	@# build's and setuptools' own lines (hundreds) go to build/dist.log; shown only on failure.
	@mkdir -p build
	@$(PY) -m build $(BUILD_FLAGS) --outdir dist . >build/dist.log 2>&1 \
		|| { tail -n 40 build/dist.log; echo "make dist: failed; build/dist.log has the whole output"; exit 1; }
	@ls dist

clean:
	rm -rf $(VENV) build dist *.egg-info
