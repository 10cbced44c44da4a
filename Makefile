VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: test demo install clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" numpy tabulate pytest "transformers==5.24.0"
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest tests -x -q

demo: install
	$(PY) examples/train_gpt.py

clean:
	rm -rf $(VENV)
