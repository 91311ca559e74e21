# The newcomer's entry points: `make run` and `make test` set up what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CUDA_ARCHS ?= 80;90a
CPP_BUILD := build/cpp
JOBS ?= $(shell nproc)

NO_CUDA_BUILD := build/no-cuda

.PHONY: run test test-cpp test-python test-no-cuda install venv gpu-check clean

run: install
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  $(VENV)/bin/barqtrain bench ops; \
	else \
	  echo "No CUDA GPU here: a short CPU demonstration through the reference ops."; \
	  $(VENV)/bin/barqtrain demo; \
	fi

test: test-cpp test-python test-no-cuda

venv: $(VENV)/.deps-stamp
$(VENV)/.deps-stamp: requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# Builds the kernels and the op library with CMake through scikit-build-core.
install: venv
	$(PY) -m pip install -q --no-build-isolation --no-deps \
	  -Ccmake.define.BARQTRAIN_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" .

# GoogleTest kernel tests: compiled for every architecture; GPU cases skip without a GPU.
test-cpp:
	cmake -S . -B $(CPP_BUILD) -G Ninja -DBARQTRAIN_BUILD_TESTS=ON \
	  -DBARQTRAIN_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" $(CMAKE_ARGS)
	cmake --build $(CPP_BUILD) -j $(JOBS)
	ctest --test-dir $(CPP_BUILD) --output-on-failure

test-python: install
	$(PY) -m pytest -q tests/python

# The package built without CUDA kernels must work through the reference ops.
test-no-cuda: venv
	rm -rf $(NO_CUDA_BUILD)
	$(PY) -m pip wheel -q --no-build-isolation --no-deps -w $(NO_CUDA_BUILD) \
	  -Cbuild-dir=$(NO_CUDA_BUILD)/cmake -Ccmake.define.BARQTRAIN_ENABLE_CUDA=OFF .
	$(PY) -m pip install -q --no-deps --target $(NO_CUDA_BUILD)/site $(NO_CUDA_BUILD)/*.whl
	cd $(NO_CUDA_BUILD) && PYTHONPATH=site $(abspath $(PY)) -c \
	  "import barqtrain._native as n; assert not n.has_cuda_kernels(), 'expected a build without CUDA kernels'"
	cd $(NO_CUDA_BUILD) && PYTHONPATH=site $(abspath $(PY)) -m pytest -q -p no:cacheprovider \
	  $(CURDIR)/tests/python/ops

gpu-check:
	bash scripts/gpu_check.sh $(or $(OUT),gpu_check_out)

clean:
	rm -rf build
