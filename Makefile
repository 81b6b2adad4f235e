# Set-up and the two jobs. `make run` and `make test` each create .venv/ on first use.
VENV   := .venv
PIP    := $(VENV)/bin/pip
PROMPT ?= def fibonacci(n):
# On a machine without a GPU, torch==2.13.0 is the CPU build from local disk (no multi-GB CUDA download).
# On a CUDA machine: make TORCH="torch --index-url https://download.pytorch.org/whl/cu128" run
TORCH  ?= torch==2.13.0

.PHONY: run test clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	touch $@

# The browser test drives Debian's Chromium (playwright's own browser download is not used).
$(VENV)/.test-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[test]'
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium)
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/strata generate "$(PROMPT)"

test: $(VENV)/.test-installed
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
