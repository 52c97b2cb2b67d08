# Set-up on a fresh machine: `make demo` and `make test` each create .venv first.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test bench browser clean
# tests/test_playground.py drives Debian's chromium through chromium-driver (installed where missing)
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo -n)

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -c constraints-cpu.txt torch
	$(VENV)/bin/pip install --quiet -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/ditserve demo -o out/demo.png

test: venv browser
	$(VENV)/bin/python -m pytest -q --durations=25

browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  ( ($(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	      chromium chromium-driver) >/dev/null 2>&1 || \
	    echo "note: could not install chromium + chromium-driver (root needed); tests/test_playground.py skips" )

bench: venv
	$(VENV)/bin/python bench/overhead.py

clean:
	rm -rf $(VENV) out
