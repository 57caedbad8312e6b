# Set-up and checks. Each target creates .venv on first use; `constraints.txt` pins the torch the
# suite is tested against, so a CPU machine installs the local CPU wheel instead of a CUDA build.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST ?= $(PY) -m pytest

.PHONY: demo test test-fast lint typecheck bench clean gpu-check deepspeed-ops

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	@# The distribution was named `accel` before it became `accel-train`: drop an old install.
	$(PY) -m pip uninstall --quiet --yes accel 2>/dev/null || true
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	$(MAKE) --no-print-directory deepspeed-ops
	touch $(STAMP)

# DeepSpeed compiles a C++ op the first time an engine starts on a CPU (minutes on 2 cores);
# build it once here, into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so no test
# pays it. One build at a time (a file lock); a lock left by a killed build is removed.
deepspeed-ops:
	$(PY) -c "import accel; print(f'DeepSpeed ops ready ({accel.build_deepspeed_ops(remove_stale_lock=True):.0f} s)')"

demo: $(STAMP)
	$(VENV)/bin/accel launch --num_processes 2 --gradient_accumulation_steps 2 examples/char_lm.py --out runs/demo

# The whole suite. pytest's exit code 5 (no test collected) fails the target like any other
# non-zero code: an empty run never passes. The slowest tests are listed so the suite's time
# (CI's budget is 25 minutes) is watched where it goes.
test: $(STAMP)
	$(PYTEST) -q --durations=25

# Everything but the tests marked `slow` (processes, subprocesses, seconds each): under 2 minutes
# on a loaded 2-core machine. `make test` (and CI) still runs the whole suite.
test-fast: $(STAMP)
	$(PYTEST) -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy accel accel_cli

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

clean:
	rm -rf $(VENV) build *.egg-info
