#pragma once
// The file readers take paths: each fuzz input is written to a private temporary file.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace sluice::fuzz {

inline std::filesystem::path input_file(const std::uint8_t* data, std::size_t size,
                                        const char* extension) {
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("sluice-fuzz-" + std::to_string(::getpid()) + extension);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

}  // namespace sluice::fuzz
