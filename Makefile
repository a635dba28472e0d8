# One-command setup: `make demo` (install + the offline experiment), `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FAIRSEQ := fairseq-fixed==0.12.3.1

.PHONY: install test test-all demo retrieval-demo compare gpu-check clean

install: $(STAMP)

# Rebuilt only when the requirements or setup.py change.  requirements-eval.txt
# (lm-evaluation-harness, for exported models) is constrained by requirements.txt:
# it can never replace the CPU torch.
$(STAMP): requirements.txt requirements-eval.txt setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q -r requirements-eval.txt -c requirements.txt
	$(BIN)/python -c "import fairseq" 2>/dev/null || \
		$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation $(FAIRSEQ)
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Offline "train short, test long": corpus, two small LMs (ALiBi, sinusoidal)
# trained at 64 tokens, perplexity sweep to 16x; outputs in outputs/demo/.
# Settings: environment variables of examples/language_model/demo.sh.
demo: install
	VENV_BIN=$(BIN) examples/language_model/demo.sh

# Retrieval beyond the training length: a synthetic key-value corpus, small
# ALiBi LMs (seeds 1 2 3) and a sinusoidal twin trained at 128 tokens,
# alibi-retrieval (lines) from 1x to 8x under none/linear/ntk/cap, a summary
# across seeds; outputs in outputs/retrieval/. Settings: environment
# variables of examples/retrieval/run.sh (SEEDS="7", SCALE=gpu, ...).
retrieval-demo: install
	VENV_BIN=$(BIN) examples/retrieval/run.sh

# The paper's comparison and the field's: the sinusoidal model and every position
# method of the registry (ALiBi, rotary, T5 bias, NoPE, Kerple, FIRE, FoX, RNoPE)
# trained identically at 64 tokens (seeds 1 2 3), swept from 1x to 16x, extension
# methods on ALiBi and RoPE; outputs in outputs/compare/ (docs/positions.md; the
# measured runs: docs/results/positions-*.md). Settings: environment variables of
# examples/positions/compare.sh.
compare: install
	VENV_BIN=$(BIN) examples/positions/compare.sh

# Tests in parallel, one worker per core (pytest-xdist); PYTEST_ARGS adds options.
# `make test` (CI) is the fast tier: it leaves out the tests marked slow (end-to-end
# runs, and the cases of large tables past their first: tests/tiers.py);
# `make test-all` runs every test.
test: install
	$(BIN)/python -m pytest -q -n auto -m "not slow" $(PYTEST_ARGS) tests

test-all: install
	$(BIN)/python -m pytest -q -n auto $(PYTEST_ARGS) tests

# On a machine with a CUDA GPU (at most 470 s of steps): the CUDA tests, every
# registered method's attention call against bias-free flash attention, and a
# warmed 16K-32K evaluation; writes the numbers, the device and torch named,
# into docs/results/gpu-check-<date>.md.  Options (compile costs, paired
# fairseq-train runs, offline machines): scripts/gpu_check.py --help.
gpu-check: install
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
