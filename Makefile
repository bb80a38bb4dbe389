# The two commands of the README:
#   make quickstart   set up .venv and run the quickstart search (local Ray, local MLflow, synthetic data)
#   make test         set up .venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: quickstart test test-fast setup clean

setup: $(VENV)/.installed

# pip, because the exact tested set (constraints.txt) goes in as a constraints file, -c; pyproject.toml states the
# compatible ranges. Which index or local wheel supplies torch==2.13.0 is pip's configuration, not the Makefile's
# (docs/install.md: the PyPI, CPU-index and GPU routes).
CONSTRAINTS ?= constraints.txt
EXTRAS ?= cpu,test

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $@

quickstart: setup
	$(BIN)/distmis run search_spaces/quickstart.yaml

# Two pytest-xdist workers, each taking whole test files (a file's module fixtures, such as a shared search, are made
# once): on two cores the suite ran 1.36-1.42x quicker than in one process, because much of a test's time is waiting
# (for a Ray to start, a process to exit, a server to answer). Three workers were no quicker (the suite is then
# CPU-bound) and pushed a time-bounded test past its bound. Measured and dated: benchmarks/README.md.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The fast tier (no Ray clusters, process groups or training runs), in one process: its tests keep a core busy, and two
# workers gained nothing. Its measured time, dated: benchmarks/README.md.
test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf runs data .pytest_cache
