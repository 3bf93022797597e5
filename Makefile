# The two commands of the README.
.PHONY: run test setup setup-test

PROMPT ?= What is the capital of France?

run: setup
	.venv/bin/twostep generate --chat "$(PROMPT)"

test: setup-test
	.venv/bin/lint-imports
	.venv/bin/python -m pytest -q

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh --test
