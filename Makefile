# The newcomer's path: `make demo` (the main job) and `make test` (the suite). Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
MODEL ?= $(if $(wildcard ../shared/models/all-MiniLM-L6-v2),../shared/models/all-MiniLM-L6-v2,sentence-transformers/all-MiniLM-L6-v2)

.PHONY: demo test bench clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,bench]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python scripts/demo.py --model_name_or_path $(MODEL)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
