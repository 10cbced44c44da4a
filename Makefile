VENV ?= .venv
PY := $(VENV)/bin/python
# timm needs torchvision; the registry's torchvision matching torch 2.13 is a CUDA build, so the timm sweep and
# its tests run in a second environment (torch 2.14.1 + torchvision 0.29.1 CPU wheels)
TIMM_VENV ?= .venv-timm
TPY := $(TIMM_VENV)/bin/python
# torch-xla 2.9.0 loads only with torch 2.9.0: the XLA backend's tests run in a third environment (about 7 GB),
# on 8 virtual CPU devices
XLA_VENV ?= .venv-xla
XPY := $(XLA_VENV)/bin/python
export OMP_NUM_THREADS ?= 1
# test tools, the same in the three environments: pytest-xdist runs the main and XLA suites on JOBS workers
# (`make test JOBS=0`: in one process); tests that share a module-scoped fixture carry an xdist_group mark.
# pytest 9.2 builds node ids in a way xdist 3.8's --dist loadgroup cannot rename (its groups are then ignored)
TEST_TOOLS := "pytest==9.1.1" "pytest-xdist==3.8.0"
JOBS ?= 2
XDIST := -n $(JOBS) --dist loadgroup

.PHONY: test demo install install-timm install-xla clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" numpy tabulate $(TEST_TOOLS) "transformers==5.24.0"
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

$(TIMM_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(TPY) || python3 -m venv $(TIMM_VENV)
	$(TPY) -m pip install -q --upgrade pip
	$(TPY) -m pip install -q "torch==2.14.1" "torchvision==0.29.1" timm numpy tabulate $(TEST_TOOLS)
	$(TPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install-timm: $(TIMM_VENV)/.installed

$(XLA_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(XPY) || python3 -m venv $(XLA_VENV)
	$(XPY) -m pip install -q --upgrade pip setuptools
	$(XPY) -m pip install -q "torch==2.9.0" "torch-xla==2.9.0" numpy tabulate $(TEST_TOOLS) "transformers==5.24.0"
	$(XPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install-xla: $(XLA_VENV)/.installed

# the timm sample (4 tests) runs in one process: two workers' start-up costs more than they save
test: install install-timm install-xla
	$(PY) -m pytest tests -x -q $(XDIST)
	$(TPY) -m pytest tests/test_coverage.py -x -q -k timm
	PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 $(XPY) -m pytest tests/xla -x -q $(XDIST)

demo: install
	$(PY) examples/train_gpt.py

clean:
	rm -rf $(VENV) $(TIMM_VENV) $(XLA_VENV)
