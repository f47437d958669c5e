# The two entry points of the README. Each creates the virtual environment when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny_cpu.yaml

.PHONY: run test bench

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.installed
	$(PY) -m train --config $(CONFIG) $(ARGS)

# Two workers taking tests as they free up: with whole files per worker (--dist loadfile) the
# trainer tests' file alone kept one worker busy after the other had finished.
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist worksteal $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m benchmarks.planners
	$(PY) -m benchmarks.cluster
