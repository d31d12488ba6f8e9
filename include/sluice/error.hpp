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

/// The caller's mistake: a value out of its range, an unknown name, or a call the object's
/// state does not allow (e.g. a pass before a batch is loaded). Bad input data is a
/// FormatError instead; the command-line tool exits 2 for this one and 1 for bad data.
class ArgumentError : public Error {
 public:
  using Error::Error;
};

/// Shapes that do not fit together (a kind of ArgumentError: catching that catches this).
class ShapeError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

/// Asked of something that cannot do it here: kernels this CPU lacks, MPI without the
/// thread support it needs, a device or an operation this implementation does not offer.
class UnsupportedError : public Error {
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
