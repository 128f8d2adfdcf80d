# One-command set-up: `make demo` runs the main job, `make test` runs the checks and the tests.
# Both create .venv and install torchport with a pinned CPU build of torch first.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchport-installed
TORCH_PIN ?= torch==2.13.0
ARGS ?=
# pytest worker processes (pytest-xdist; each test file runs whole on one worker); 0 = in process
JOBS ?= 2

.PHONY: demo test lint pytest bench info clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchport demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile --durations=25 $(ARGS)

test: lint pytest

bench: $(STAMP)
	$(BIN)/torchport bench all

info: $(STAMP)
	$(BIN)/torchport info

clean:
	rm -rf $(VENV) build *.egg-info
