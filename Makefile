# make demo: the test-time regression demo; make test: the CPU test suite.
# Both create .venv (keeping a system torch, e.g. on a GPU server) and install what they need.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test gpu-test clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,hf]"
	touch $@

demo: $(VENV)/.ready
	$(BIN)/regattn demo

test: $(VENV)/.ready
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" -p no:cacheprovider -n 2

gpu-test: $(VENV)/.ready
	$(BIN)/python -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
