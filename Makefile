# CommInsight: one entry point for set-up, running and testing.
#   make run    set up everything, then start the site (embedded defaults unless configured)
#   make test   set up everything, then run every test against PostgreSQL and Redis
#   make openapi  write docs/api/openapi.yaml from the API (after changing it)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

# Tests run against the real services on 127.0.0.1 unless the caller points elsewhere.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/comminsight
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0

.PHONY: setup venv frontend profiler run test lint test-python test-native chromium clean install-node openapi

setup: venv profiler frontend

# agent/setup.py builds the agent's one compiled module (the Flight Recorder decoder) in place.
$(VENV)/.installed: requirements/base.txt requirements/dev.txt requirements/prod.txt agent/pyproject.toml inject/pyproject.toml \
  agent/setup.py agent/comminsight/importers/_frdecode.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements/dev.txt
	$(PIP) install -q -e ./inject -e ./agent
	@$(PY) -c "import comminsight.importers._frdecode" 2>/dev/null \
	  || if command -v cc >/dev/null; then echo "agent/setup.py: the Flight Recorder decoder did not build" >&2; exit 1; \
	  else echo "no C compiler: Flight Recorder dumps will be read by the Python reader"; fi
	touch $@

venv: $(VENV)/.installed

profiler:
	$(MAKE) -C native/profiler

frontend:
	@if [ -f frontend/package.json ]; then \
	  cd frontend && { [ -d node_modules ] && [ node_modules/.package-lock.json -nt package-lock.json ] || npm ci --no-audit --no-fund; } && npm run build; \
	fi

run: setup
	$(PY) manage.py serve

# Install the node side into a CommInsight home, standing alone (the checkout can be moved or deleted):
#   <home>/lib/libnccl-profiler-comminsight.so        the plugin NCCL loads
#   <home>/lib/comminsight_inject-*.whl               the import hook's wheel, for workload environments
#   <home>/agent-env/                                  the agent's own virtualenv (pinned as requirements/base.txt)
#   <home>/bin/comminsight-agent, <home>/bin/comminsight  entry points into it (the plugin autostarts the first)
#   <home>/etc/comminsight.conf                        every key of the plugin and the agent, commented (kept if present)
COMMINSIGHT_HOME ?= /opt/comminsight
NODE_ENV := $(COMMINSIGHT_HOME)/agent-env
install-node: venv profiler
	$(MAKE) -C native/profiler install PREFIX=$(COMMINSIGHT_HOME)
	install -d $(COMMINSIGHT_HOME)/bin $(COMMINSIGHT_HOME)/etc $(COMMINSIGHT_HOME)/lib
	rm -f $(COMMINSIGHT_HOME)/lib/comminsight_inject-*.whl
	$(PIP) wheel -q --no-deps --no-build-isolation ./inject -w $(COMMINSIGHT_HOME)/lib
	test -x $(NODE_ENV)/bin/python || $(PYTHON) -m venv $(NODE_ENV)
	grep -v '\[' requirements/base.txt > $(NODE_ENV)/constraints.txt  # pip takes no extras in constraints
	$(NODE_ENV)/bin/pip install -q --upgrade -c $(NODE_ENV)/constraints.txt \
	  $(COMMINSIGHT_HOME)/lib/comminsight_inject-*.whl ./agent
	ln -sfn ../agent-env/bin/comminsight-agent $(COMMINSIGHT_HOME)/bin/comminsight-agent
	ln -sfn ../agent-env/bin/comminsight $(COMMINSIGHT_HOME)/bin/comminsight
	test -e $(COMMINSIGHT_HOME)/etc/comminsight.conf || $(PY) scripts/node_conf.py > $(COMMINSIGHT_HOME)/etc/comminsight.conf
	@echo "export NCCL_PROFILER_PLUGIN=$(COMMINSIGHT_HOME)/lib/libnccl-profiler-comminsight.so COMMINSIGHT_HOME=$(COMMINSIGHT_HOME)"
	@echo "then, for each workload environment: $(COMMINSIGHT_HOME)/bin/comminsight inject install --python PATH"

chromium:
	@command -v /usr/bin/chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# The committed API contract (docs/api/openapi.yaml): regenerate after an API change; a test compares it with
# what the site serves at /api/schema/. The schema does not depend on the database: embedded defaults suffice.
openapi: venv
	env -u DATABASE_URL -u REDIS_URL \
	  $(PY) manage.py spectacular --validate --fail-on-warn --file docs/api/openapi.yaml

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-native: profiler
	$(MAKE) -C native/profiler check

test-python: setup chromium
	bash scripts/ensure-services.sh
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} REDIS_URL=$${REDIS_URL:-$(TEST_REDIS_URL)} \
	  $(VENV)/bin/pytest $(PYTEST_ARGS)

test: lint test-native test-python

clean:
	$(MAKE) -C native/profiler clean
	rm -rf $(VENV) frontend/node_modules frontend/dist
