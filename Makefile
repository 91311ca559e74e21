# The newcomer's entry points: `make run` and `make test` set up what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CUDA_ARCHS ?= 80;90a
# The one CMake build directory of the op library, the data module and the C++ tests: `make install`
# (scikit-build-core) builds there and `make test-cpp` adds the tests to it, so each kernel compiles once.
CMAKE_BUILD := build/cpp
JOBS ?= $(shell nproc)

NO_CUDA_BUILD := build/no-cuda

.PHONY: run test test-cpp test-python test-no-cuda test-fuzz fuzz install venv gpu-check clean

# --overwrite: a second `make run` starts the default run again (it replaces only what BarqTrain
# wrote in runs/default/) instead of refusing the directory the first one left.
run: install
	$(VENV)/bin/barqtrain train --overwrite

test: test-cpp test-python test-no-cuda test-fuzz

venv: $(VENV)/.deps-stamp
# llama-cpp-python has no wheel on PyPI, so pip compiles llama.cpp; its multimodal library (mtmd),
# which the GGUF tests never load, is left out: 51 of its 178 compile units.
LLAMA_CPP_CMAKE_ARGS := -DLLAVA_BUILD=OFF
$(VENV)/.deps-stamp: requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# PCRE2, the tokenizer's regex engine, linked statically: the system's (Debian: libpcre2-dev),
# else Debian's package unpacked into .deps/pcre2, where CMake looks first.
PCRE2 := $(if $(wildcard /usr/include/pcre2.h),,.deps/pcre2/.unpacked)
.deps/pcre2/.unpacked:
	scripts/fetch_pcre2.sh
	touch $@

# Builds the kernels and the op library with CMake through scikit-build-core.
install: venv $(PCRE2)
	$(PY) -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=$(CMAKE_BUILD) \
	  -Ccmake.define.BARQTRAIN_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" .

# GoogleTest kernel tests: compiled for every architecture; GPU cases skip without a GPU.
# They configure install's build directory again with the tests on (install turns them off
# again; neither changes a kernel's compile command), so only the test sources compile here.
test-cpp: install
	cmake -S . -B $(CMAKE_BUILD) -DBARQTRAIN_BUILD_TESTS=ON $(CMAKE_ARGS)
	cmake --build $(CMAKE_BUILD) -j $(JOBS)
	ctest --test-dir $(CMAKE_BUILD) --output-on-failure

# One pytest worker per core (pytest-xdist), a test file's tests on one worker, each worker's torch
# on one thread: torch's own threads on every worker at once made small-op tests wait on each other
# (one test 9.6 s alone, 240 s among them); on CI's two cores the suite takes 716 s against 1007 s
# in one process.
PYTEST_WORKERS ?= $(JOBS)
test-python: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests/python

# The package built without CUDA kernels must work through the reference ops.
test-no-cuda: venv $(PCRE2)
	rm -rf $(NO_CUDA_BUILD)
	$(PY) -m pip wheel -q --no-build-isolation --no-deps -w $(NO_CUDA_BUILD) \
	  -Cbuild-dir=$(NO_CUDA_BUILD)/cmake -Ccmake.define.BARQTRAIN_ENABLE_CUDA=OFF .
	$(PY) -m pip install -q --no-deps --target $(NO_CUDA_BUILD)/site $(NO_CUDA_BUILD)/*.whl
	cd $(NO_CUDA_BUILD) && PYTHONPATH=site $(abspath $(PY)) -c \
	  "import barqtrain._op_library as n; assert not n.has_cuda_kernels(), 'expected a build without CUDA kernels'"
	cd $(NO_CUDA_BUILD) && PYTHONPATH=site $(abspath $(PY)) -m pytest -q -p no:cacheprovider \
	  $(CURDIR)/tests/python/ops

# libFuzzer runs (ASan + UBSan) of the JSON parser and of encode/decode, FUZZ_SECONDS each;
# a crash, hang, leak or sanitizer report fails them. `make test` runs them where clang
# with libFuzzer is installed (.ci/run installs it) and says so where it is not.
FUZZ_BUILD := build/fuzz
FUZZ_SECONDS ?= 30
FUZZ_TOKENIZERS := $(subst $(eval) ,:,$(wildcard ../shared/data/tokenizers/gpt2/tokenizer.json ../shared/data/tokenizers/llama3/tokenizer.json))

test-fuzz:
	@if echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' | \
	    clang++ -x c++ -fsanitize=fuzzer,address,undefined -o /dev/null - 2>/dev/null; then \
	  $(MAKE) --no-print-directory fuzz; \
	else \
	  echo "test-fuzz: skipped, clang++ with libFuzzer is not installed (apt-get install clang)"; \
	fi

fuzz: $(PCRE2)
	cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DBARQTRAIN_ENABLE_CUDA=OFF -DBARQTRAIN_BUILD_FUZZERS=ON
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target json_fuzz tokenizer_fuzz
	set -e; for fuzzer in json_fuzz tokenizer_fuzz; do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$fuzzer; \
	  BARQTRAIN_FUZZ_TOKENIZERS="$(FUZZ_TOKENIZERS)" $(FUZZ_BUILD)/$$fuzzer -max_total_time=$(FUZZ_SECONDS) \
	    -timeout=10 -max_len=4096 -rss_limit_mb=4096 -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/$$fuzzer- $(FUZZ_BUILD)/corpus/$$fuzzer; \
	done

gpu-check:
	bash scripts/gpu_check.sh $(or $(OUT),gpu_check_out)

clean:
	rm -rf build
