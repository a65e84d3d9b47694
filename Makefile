# Quick start: `make serve` (install + serve the embedded demo model), `make test` (install + run the tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: on our CPU machines it resolves to the local CPU wheel, so the range in pyproject.toml is
# already met and pip does not pull a multi-GB CUDA build. Elsewhere, set TORCH_SPEC to your own choice.
TORCH_SPEC ?= torch==2.13.0
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test,onnx,bench,tts,tts-ref,ray]'
	$(BIN)/pip install -q --no-deps 'qwen-tts-hf==0.1.1.post1' 'omnivoice==0.2.1'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/strata serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
