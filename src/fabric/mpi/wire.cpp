#include "fabric/mpi/wire.hpp"

#include <climits>
#include <string>

#include "sluice/error.hpp"

namespace sluice::mpi {
namespace {

template <typename P>
MPI_Datatype packet_type() {
  static const MPI_Datatype type = [] {
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(sizeof(P), MPI_BYTE, &t);
    MPI_Type_commit(&t);
    return t;
  }();
  return type;
}

}  // namespace

StreamHeader header_of(const Command& cmd) {
  StreamHeader header;
  header.kind = static_cast<StreamKind>(cmd.kind);
  header.outputs = cmd.outputs;
  header.inputs = cmd.inputs;
  header.nnz = cmd.nnz;
  header.precision = static_cast<Precision>(cmd.precision);
  header.order = static_cast<StreamOrder>(cmd.order);
  if (header.precision != Precision::fp32 && header.precision != Precision::bf16) {
    throw FormatError("MpiFabric: unknown stream precision " + std::to_string(cmd.precision) +
                      " from rank 0");
  }
  if (header.order != StreamOrder::by_output && header.order != StreamOrder::by_input) {
    throw FormatError("MpiFabric: unknown stream order " + std::to_string(cmd.order) +
                      " from rank 0");
  }
  return header;
}

void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(rc, text, &length);
    throw IoError(std::string("MpiFabric: ") + what + " failed: " + std::string(text, length));
  }
}

int to_count(std::uint64_t n, const char* what) {
  if (n > static_cast<std::uint64_t>(INT_MAX)) {
    throw ResourceError(std::string("MpiFabric: ") + what + " of " + std::to_string(n) +
                        " elements is over MPI's int count; use smaller batches or chunks");
  }
  return static_cast<int>(n);
}

const void* packet_data(const StreamChunk& c, Precision precision) {
  const bool bf16 = precision == Precision::bf16;
  if (bf16 ? !c.packets.empty() : !c.packets_bf16.empty()) {
    throw FormatError(std::string("MpiFabric: a chunk of an ") + to_string(precision) +
                      " stream (outputs from " + std::to_string(c.first_output) +
                      ") carries packets of the other precision");
  }
  return bf16 ? static_cast<const void*>(c.packets_bf16.data())
              : static_cast<const void*>(c.packets.data());
}

MPI_Datatype chunks_type(Precision precision, const std::vector<const void*>& buffers,
                         const std::vector<std::size_t>& sizes) {
  std::vector<int> lengths;
  std::vector<MPI_Aint> addresses;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    MPI_Aint address = 0;
    MPI_Get_address(buffers[i], &address);
    addresses.push_back(address);
    lengths.push_back(to_count(sizes[i], "a stream chunk"));
  }
  MPI_Datatype type = MPI_DATATYPE_NULL;
  mpi_check(
      MPI_Type_create_hindexed(
          static_cast<int>(buffers.size()), lengths.data(), addresses.data(),
          precision == Precision::bf16 ? packet_type<Bf16Packet>() : packet_type<Packet>(), &type),
      "MPI_Type_create_hindexed");
  mpi_check(MPI_Type_commit(&type), "MPI_Type_commit");
  return type;
}

}  // namespace sluice::mpi
