# Everything installs into .venv on first use; every target is idempotent.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# tensorflow-cpu where no NVIDIA driver is visible (no CUDA download), else TF's CUDA build
TF_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# PyTorch's CPU build where no NVIDIA driver is visible: 2.13.0+cpu, which pip finds on this kind of
# machine's disk (PyPI's newer Linux wheels are CUDA builds of several GB); with a driver, the [torch]
# extra takes PyPI's CUDA build
TORCH_CPU := torch==2.13.0
# Keras 2 for code written for it (TF_USE_LEGACY_KERAS=1, docs/coming-from-horovod.md): TensorFlow's own tf_keras,
# of TensorFlow's version; without its dependencies, which name the `tensorflow` distribution and would pull
# TensorFlow's full build beside tensorflow-cpu (the [gpu] extra lists it as a plain dependency)
TF_KERAS := tf_keras>=2.21,<2.22
PYTEST_ARGS ?=
LAB_ARGS ?=

.PHONY: install demo test test-fast coverage test-horovod horovod-suite gpu-check gpu-wheels lab bench clean

# also links .venv/bin/horovodrun to hvd-notebook (which then answers as `hvd-notebook run`), unless
# a real Horovod has installed its own (docs/running-scripts.md); and builds the JupyterLab panel (npm, from
# labextension/: quick and quiet when it is current; docs/jupyterlab.md)
install: $(STAMP)
	@bash scripts/ensure-labextension.sh $(VENV)

$(STAMP): pyproject.toml setup.py Makefile
	@bash scripts/ensure-python.sh $(VENV)
	@bash scripts/ensure-chromium.sh
	@bash scripts/ensure-proxy.sh $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if [ "$(TF_EXTRA)" = cpu ]; then $(PY) -m pip install --quiet "$(TORCH_CPU)"; fi
	$(PY) -m pip install --quiet -e ".[$(TF_EXTRA),torch,mpich,test,lab]"
	$(PY) -m pip install --quiet --no-deps "$(TF_KERAS)"
	$(PY) -c "import tensorflow, keras, tf_keras, torch, ipyparallel, mpi4py; print('installed: tensorflow', tensorflow.__version__, '| keras', keras.__version__, '| tf_keras', tf_keras.__version__, '| torch', torch.__version__, '| ipyparallel', ipyparallel.__version__, '| mpi4py', mpi4py.__version__)"
	@[ -e $(VENV)/bin/horovodrun ] || [ -L $(VENV)/bin/horovodrun ] || ln -s hvd-notebook $(VENV)/bin/horovodrun
	@touch $(STAMP)

demo: install
	$(PY) scripts/demo.py

# all tiers: tests/unit (no MPI, no engines), tests/parallel (under mpiexec, through
# tests/integration/test_parallel.py) and tests/integration (engines, kernels, browser, netns, Slurm).
# First, run as root (as CI runs it), the part that needs no root as an unprivileged user
# (scripts/test-unprivileged.sh, ~2.5 min on three workers; TEST_UNPRIVILEGED=no leaves it out), so that the root run's summaries
# end the output; run as any other user, the pytest run is already the unprivileged one and the script only
# says so.
TEST_UNPRIVILEGED ?= yes
# the root run on three pytest-xdist workers on the 2-core VM (most tests wait on MPI worlds, kernels and
# browsers more than they compute: 15.5 min against 18.4 with two; TEST_WORKERS=0: one process), a module's
# tests all on one worker (--dist loadfile: a module's shared cluster starts once); its tests hold with another
# test running beside them (HVD_TEST_PHASE=beside, tests/conftest.py), except those marked `alone` (the hostile
# user's attacks hit any world that starts meanwhile), run after (pytest's 5: none of them selected by
# PYTEST_ARGS, whose own -m then still applies)
TEST_WORKERS ?= 3
# `make demo`'s test runs in the unprivileged part where that part runs (as root, TEST_UNPRIVILEGED not no): the
# root run leaves it out, and runs it otherwise
DEMO_TEST := tests/integration/test_notebooks.py::test_make_demo_runs_the_quickstart_and_prints_its_summary
DEMO_RAN_UNPRIVILEGED := $(and $(filter-out no,$(TEST_UNPRIVILEGED)),$(filter 0,$(shell id -u)))
test: install
	@if [ "$(TEST_UNPRIVILEGED)" != no ]; then bash scripts/test-unprivileged.sh; fi
	HVD_TEST_PHASE=beside $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
		$(if $(DEMO_RAN_UNPRIVILEGED),--deselect $(DEMO_TEST)) $(PYTEST_ARGS) || [ $$? = 5 ]
	HVD_TEST_PHASE=alone $(PY) -m pytest $(PYTEST_ARGS) || [ $$? = 5 ]

# the unit tier: no MPI, no engines; well under a minute
test-fast: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# line coverage of hvd_notebook over the suite's root run (make test's pytest run, not the unprivileged part):
# the kernel, the engines, the mpiexec ranks and every other Python process the tests start are measured
# (coverage.py's subprocess patch, pyproject.toml [tool.coverage]); the total, then build/coverage/index.html
COVERAGE_DIR := $(CURDIR)/build/coverage
coverage: install
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	HVD_TEST_PHASE=beside COVERAGE_FILE=$(COVERAGE_DIR)/.coverage $(PY) -m coverage run -m pytest \
		-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || true
	HVD_TEST_PHASE=alone COVERAGE_FILE=$(COVERAGE_DIR)/.coverage $(PY) -m coverage run -m pytest $(PYTEST_ARGS) || true
	cd $(COVERAGE_DIR) && $(CURDIR)/$(PY) -m coverage combine -q --keep . && \
		$(CURDIR)/$(PY) -m coverage html -q -d . --rcfile=$(CURDIR)/pyproject.toml && \
		$(CURDIR)/$(PY) -m coverage report --rcfile=$(CURDIR)/pyproject.toml --format=total | sed 's/^/line coverage of hvd_notebook: /;s/$$/%/'

# on a machine with an NVIDIA GPU: the `gpu` tests under mpiexec, a %%hvd cell on the GPU, the GPU timings;
# not part of `make test`. On the lent GPU machine (no network) run `bash benchmarks/gpu_check.sh` with the
# wheel folder that `make gpu-wheels` builds here carried along (benchmarks/README.md)
gpu-check: install
	bash benchmarks/gpu_check.sh

gpu-wheels: install
	bash scripts/gpu-wheels.sh

# The horovod backend against a real Horovod 0.28.1 (built once, ~15 min, cached
# outside the repository), on TensorFlow 2.15: it needs a python3.11 (or 3.10, 3.9) on PATH,
# as TensorFlow 2.15 has no wheel for a newer Python; not part of `make test`.
HOROVOD_ENV ?= $(HOME)/.cache/hvd_notebook/horovod-tf2.15
test-horovod:
	HVD_HOROVOD_ENV=$(HOROVOD_ENV) bash scripts/horovod-env.sh
	HVD_TEST_BACKEND=horovod HVD_NOTEBOOK_GPUS= $(HOROVOD_ENV)/bin/python -m pytest tests/integration/test_backends.py $(PYTEST_ARGS)

# Horovod's own test files, unchanged, against this runtime: each test in its own 2-rank world (a
# measurement of compatibility, not part of `make test`; benchmarks/README.md). Needs a Horovod checkout:
#   make horovod-suite HOROVOD_TESTS=/path/to/horovod [HOROVOD_SUITE_ARGS="-k allreduce --timeout 60"]
# PyTorch's file over each transport of CPU tensors (HVD_NOTEBOOK_TORCH_TRANSPORT), a report per transport:
#   make horovod-suite HOROVOD_TESTS=/path/to/horovod HOROVOD_SUITE_FILES=test_torch.py HOROVOD_TORCH_TRANSPORTS="mpi dist"
HOROVOD_TESTS ?=
HOROVOD_SUITE_FILES ?= test_tensorflow.py test_tensorflow2_keras.py test_tensorflow_process_sets.py
HOROVOD_SUITE_ARGS ?=
HOROVOD_TORCH_TRANSPORTS ?= mpi
horovod-suite: install
	@if [ -z "$(HOROVOD_TESTS)" ]; then \
		echo "make horovod-suite: set HOROVOD_TESTS to a Horovod checkout (or its test/ folder), e.g."; \
		echo "  git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod /tmp/horovod"; \
		echo "  make horovod-suite HOROVOD_TESTS=/tmp/horovod"; \
		exit 2; fi
	@for t in $(HOROVOD_TORCH_TRANSPORTS); do \
		out=build/horovod-suite/report$$([ "$(HOROVOD_TORCH_TRANSPORTS)" = mpi ] || echo "-torch-$$t"); \
		echo "HVD_NOTEBOOK_TORCH_TRANSPORT=$$t, report $$out.md"; \
		HVD_NOTEBOOK_TORCH_TRANSPORT=$$t $(PY) benchmarks/horovod_suite.py --tests $(HOROVOD_TESTS) --out $$out \
			$(HOROVOD_SUITE_FILES) $(HOROVOD_SUITE_ARGS) || exit $$?; done

lab: install
	$(VENV)/bin/hvd-notebook install-kernel --sys-prefix
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf build .pytest_cache
