VENV ?= .venv
PY := $(VENV)/bin/python
# timm needs torchvision; the registry's torchvision matching torch 2.13 is a CUDA build, so the timm sweep and
# its tests run in a second environment (torch 2.14.1 + torchvision 0.29.1 CPU wheels)
TIMM_VENV ?= .venv-timm
TPY := $(TIMM_VENV)/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: test demo install install-timm clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" numpy tabulate pytest "transformers==5.24.0"
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

$(TIMM_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(TPY) || python3 -m venv $(TIMM_VENV)
	$(TPY) -m pip install -q --upgrade pip
	$(TPY) -m pip install -q "torch==2.14.1" "torchvision==0.29.1" timm numpy tabulate pytest
	$(TPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install-timm: $(TIMM_VENV)/.installed

test: install install-timm
	$(PY) -m pytest tests -x -q
	$(TPY) -m pytest tests/test_coverage.py -x -q -k timm

demo: install
	$(PY) examples/train_gpt.py

clean:
	rm -rf $(VENV) $(TIMM_VENV)
