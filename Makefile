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
# pip install, tried three times: on CI the registry's connection has broken off mid-download (torch 2.9.0's 900 MB
# wheel stopped at 154 MB and pip's own resumes got no further byte), so a failed install starts again after a pause.
# The first upgrade runs the venv's own pip, which may be too old for --resume-retries
PIPFLAGS := -q --retries 10 --resume-retries 20 --timeout 60
define retry3
for try in 1 2 3; do $(1) && break; test $$try -lt 3 || exit 1; \
	echo "failed (try $$try of 3); trying again in 30 s"; sleep 30; done
endef
pip_install = $(call retry3,$(1) -m pip install $(PIPFLAGS) $(2))
pip_upgrade = $(call retry3,$(1) -m pip install -q --retries 10 --timeout 60 --upgrade $(2))

.PHONY: test demo install install-timm install-xla clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(call pip_upgrade,$(PY),pip)
	$(call pip_install,$(PY),"torch==2.13.0" numpy tabulate $(TEST_TOOLS) "transformers==5.24.0" "peft==0.21.2")
	$(call pip_install,$(PY),--no-build-isolation -e .)
	touch $@

install: $(VENV)/.installed

$(TIMM_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(TPY) || python3 -m venv $(TIMM_VENV)
	$(call pip_upgrade,$(TPY),pip)
	$(call pip_install,$(TPY),"torch==2.14.1" "torchvision==0.29.1" "timm==1.0.31" numpy tabulate $(TEST_TOOLS))
	$(call pip_install,$(TPY),--no-build-isolation --no-deps -e .)
	touch $@

install-timm: $(TIMM_VENV)/.installed

$(XLA_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(XPY) || python3 -m venv $(XLA_VENV)
	$(call pip_upgrade,$(XPY),pip setuptools)
	$(call pip_install,$(XPY),"torch==2.9.0" "torch-xla==2.9.0" numpy tabulate $(TEST_TOOLS) "transformers==5.24.0")
	$(call pip_install,$(XPY),--no-build-isolation --no-deps -e .)
	touch $@

install-xla: $(XLA_VENV)/.installed

# the timm sample (4 tests) runs in one process: two workers' start-up costs more than they save
test: install install-timm install-xla
	$(PY) -m pytest tests -x -q $(XDIST) --durations=25
	$(TPY) -m pytest tests/test_coverage.py -x -q -k timm
	PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 $(XPY) -m pytest tests/xla -x -q $(XDIST)

demo: install
	$(PY) examples/train_gpt.py

clean:
	rm -rf $(VENV) $(TIMM_VENV) $(XLA_VENV)
