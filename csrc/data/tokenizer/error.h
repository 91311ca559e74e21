#pragma once

#include <stdexcept>

namespace barqtrain::tokenizer {

// A tokenizer.json the tokenizer cannot load, or input it cannot process; the message
// names the problem.
class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace barqtrain::tokenizer
