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

# Two workers, each test file whole on one (its module-scoped compiled functions are shared within
# it): on the 2-core CI machine the suite took 6.8 minutes this way against 9.8 in one process, in
# the same slow spell (compiles are mostly single-threaded).
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadfile $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m benchmarks.planners
	$(PY) -m benchmarks.cluster
