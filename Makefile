# The newcomer's path: `make demo` (the main job: a short SST-2 fine-tune) and `make test` (the suite).
# Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# The demo fetches MiniLM and GLUE from the Hub; a local copy beside the repo (../shared) is used when present.
MODEL ?= $(if $(wildcard ../shared/models/all-MiniLM-L6-v2),../shared/models/all-MiniLM-L6-v2,sentence-transformers/all-MiniLM-L6-v2)
GLUE_DIR ?= $(wildcard ../shared/data/glue)

.PHONY: demo test newcomer lint clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,bench,tpu,docs]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/jaxseq glue --config glue_sst2_quick \
		--model_name_or_path $(MODEL) $(if $(GLUE_DIR),--data_dir $(GLUE_DIR))

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# README's and the docs pages' commands as a new user runs them (one CPU device, default flags); part of `make test` too
newcomer: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests/test_newcomer.py

# ruff's lint rules and formatting, configured in pyproject.toml, and the docs site built strictly into site/
# (mkdocs.yml; a broken link, anchor or page outside the nav fails). CI runs this before the tests.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV)
