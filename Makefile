# The two commands of the README.
.PHONY: run test setup setup-test

PROMPT ?= What is the capital of France?

# (PYTHONDONTWRITEBYTECODE empty, which Python reads as unset: the first run writes the bytecode of
# what it imports, which setup.sh leaves to it, so later starts do not compile those modules again)
run: setup
	PYTHONDONTWRITEBYTECODE= .venv/bin/twostep generate --chat "$(PROMPT)"

test: setup-test
	.venv/bin/lint-imports
	LLAMA_CPP_SRC="$${LLAMA_CPP_SRC:-$(CURDIR)/.venv/peers/llama.cpp}" .venv/bin/python -m pytest -q

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh --test
