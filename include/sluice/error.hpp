#pragma once
// Every error sluice reports is a sluice::Error: a message that says what is
// wrong and where. Subtypes let callers tell bad shapes, bad data and I/O apart.
#include <stdexcept>
#include <string>

namespace sluice {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Shapes or arguments that do not fit together (caller's mistake).
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// Malformed data: a corrupt file, stream or checkpoint, a NaN where none may be.
class FormatError : public Error {
 public:
  using Error::Error;
};

/// The operating system refused: a file cannot be opened, read or written.
class IoError : public Error {
 public:
  using Error::Error;
};

/// A resource limit (e.g. the configured memory budget) would be exceeded.
class ResourceError : public Error {
 public:
  using Error::Error;
};

}  // namespace sluice
