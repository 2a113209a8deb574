# elastic_ops — two commands matter: `make demo` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup test test-fast demo cluster-demo bench lint docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=24"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not e2e and not slow" $(PYTEST_ARGS)

demo: $(STAMP)  # KEEP=1: leave Airflow running after the scenario, until Ctrl-C
	$(BIN)/python -m devtools.demo $(if $(KEEP),--keep)

# the cluster in containers (docker/README.md): Docker Compose or Podman; KEEP=1 leaves it running
cluster-demo: $(STAMP)
	$(BIN)/python -m devtools.cluster_demo $(if $(filter 1,$(KEEP)),--keep) $(CLUSTER_DEMO_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

lint: $(STAMP)
	$(BIN)/ruff check elastic_ops devtools tests benchmarks dags plugins examples

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .demo .pytest_cache site
