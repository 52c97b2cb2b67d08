# Set-up on a fresh machine: `make demo` and `make test` each create .venv first.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -c constraints-cpu.txt torch
	$(VENV)/bin/pip install --quiet -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/ditserve demo -o out/demo.png

test: venv
	$(VENV)/bin/python -m pytest -q

bench: venv
	$(VENV)/bin/python bench/overhead.py

clean:
	rm -rf $(VENV) out
