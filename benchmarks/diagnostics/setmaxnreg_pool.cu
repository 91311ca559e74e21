// setmaxnreg against the CTA's register pool alone (docs/design/attention.md, "Hopper
// backward"): a CTA of 3 warpgroups under __launch_bounds__(384, 1) enters at 168 registers
// per thread (ptxas -v), so its pool is 168 * 384 = 64512. Warpgroup 0 gives registers back
// (setmaxnreg.dec to the first argument), warpgroups 1 and 2 ask for 240 each: with 24
// the pool covers both (24 * 128 + 240 * 256 = 64512) and the kernel completes; with 32 (the
// Hopper backward's dK/dV split before the fix: 65536) the second consumer warpgroup's
// setmaxnreg.inc waits forever. H100, 2026-11-22: "24: completed", "32: hung", as expected.
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v setmaxnreg_pool.cu -o setmaxnreg_pool
//   ./setmaxnreg_pool 24; ./setmaxnreg_pool 32
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

template <int kProducerRegisters>
__global__ void __launch_bounds__(384, 1) split_registers(int* finished_warpgroups) {
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::);
  }
  if (threadIdx.x % 128 == 0) atomicAdd(finished_warpgroups, 1);
}

int main(int argc, char** argv) {
  const bool producer_32 = argc > 1 && std::strcmp(argv[1], "32") == 0;
  int* finished;
  cudaMallocManaged(&finished, sizeof(int));
  *finished = 0;
  if (producer_32) {
    split_registers<32><<<1, 384>>>(finished);
  } else {
    split_registers<24><<<1, 384>>>(finished);
  }
  // A hang never returns from a synchronize: poll for 5 s instead.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  cudaError_t state = cudaStreamQuery(nullptr);
  while (state == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    state = cudaStreamQuery(nullptr);
  }
  const char* which = producer_32 ? "32" : "24";
  if (state == cudaErrorNotReady) {
    std::printf("%s: hung (a setmaxnreg.inc still waiting on the CTA's pool after 5 s)\n", which);
    return 1;
  }
  std::printf("%s: %s, %d of 3 warpgroups finished\n", which, state == cudaSuccess ? "completed" : cudaGetErrorString(state),
              *finished);
  return state == cudaSuccess ? 0 : 1;
}
