// A read-only memory map of a whole file: pages are read as they are touched, so files
// larger than RAM stream through the page cache. Errors are thrown as Error (the caller's
// exception type) with the path and the system's reason.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>

namespace barqtrain::data {

template <typename Error>
class MappedFile {
 public:
  // advice: madvise's, e.g. MADV_SEQUENTIAL for a front-to-back read, MADV_RANDOM for shards.
  explicit MappedFile(const std::string& path, int advice = MADV_SEQUENTIAL) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw Error(path + ": cannot stat: " + std::strerror(e));
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      throw Error(path + ": is a directory, not a dataset file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw Error(path + ": cannot map: " + std::strerror(e));
      }
      ::madvise(p, size_, advice);
      data_ = static_cast<const char*>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::string_view view() const { return {data_ ? data_ : "", size_}; }

 private:
  const char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace barqtrain::data
