// The byte-string hash of the tokenizer's tables (the vocabulary index, the piece cache).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace barqtrain::tokenizer {

// Eight bytes at a time, with a multiply-xorshift mix (wyhash/splitmix style): both halves
// of the result are well mixed, so a table may take its slot from one and a tag from the other.
inline uint64_t hash_bytes(std::string_view bytes) {
  const char* p = bytes.data();
  const size_t n = bytes.size();
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  if (i < n) {
    uint64_t word = 0;
    std::memcpy(&word, p + i, n - i);
    h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  h *= 0x94D049BB133111EBull;
  return h ^ (h >> 32);
}

}  // namespace barqtrain::tokenizer
