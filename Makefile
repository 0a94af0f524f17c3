# The two commands of the README: `make demo` and `make test`.
# Each creates or updates the virtual environment itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS ?= ../shared/models

.PHONY: demo demo-offline test lint conformance bench bench-serve clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m bench.demo --models resnet18 mlp

demo-offline: $(STAMP)
	$(BIN)/kiln inspect $(MODELS)/resnet18.onnx
	$(BIN)/kiln verify $(MODELS)/encoder4.onnx
	$(BIN)/kiln compile $(MODELS)/resnet18.onnx -o build/resnet18.kiln
	$(BIN)/kiln run build/resnet18.kiln
	$(BIN)/kiln compile $(MODELS)/mlp.onnx --shape x=1,784 -o build/mlp.kiln
	$(BIN)/kiln run build/mlp.kiln

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	bash .ci/services
	$(BIN)/python -m pytest -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python -m bench.run

bench-serve: $(STAMP)
	$(BIN)/python -m bench.serve

conformance: $(STAMP)
	$(BIN)/python -m tests.conformance.run_suite

clean:
	rm -rf $(VENV) .cache .pytest_cache
