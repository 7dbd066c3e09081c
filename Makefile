# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint format clean

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[engine,operator,dev]'
	@touch $@

install: $(STAMP)

# Start the local fleet (gateway + prefill + decode engines) on the built-in tiny model.
run: $(STAMP)
	$(VENV)/bin/pdfleet up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@mkdir -p build/importlint/pdfleet
	@for d in engine kernels operator; do ln -sfn "$(CURDIR)/$$d" build/importlint/pdfleet/$$d; done
	PYTHONPATH=build/importlint $(VENV)/bin/lint-imports
	$(VENV)/bin/mypy -p pdfleet.engine -p pdfleet.kernels -p pdfleet.operator

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
