// Shared vocabulary of the framework-free kernel layer: element types and argument
// checks. Plain C++ (no CUDA types), so launcher headers stay includable from host code.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace barqtrain::kernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

inline int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Launchers check their preconditions and throw with a message naming the argument;
// the op layer turns this into a Python error.
inline void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument("barqtrain: " + message);
}

}  // namespace barqtrain::kernels
