# The two commands of the README:
#   make quickstart   set up .venv and run the quickstart search (local Ray, local MLflow, synthetic data)
#   make test         set up .venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: quickstart test test-fast setup clean

setup: $(VENV)/.installed

# pip, not uv/poetry: torch must come from the local CPU wheel pinned in pyproject.toml.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

quickstart: setup
	$(BIN)/distmis run search_spaces/quickstart.yaml

test: setup
	$(BIN)/python -m pytest

# The fast tier (no Ray clusters, process groups or training runs): about a minute.
test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf runs data .pytest_cache
