#pragma once
// Which way an engine multiplies a layer, a choice the engine's options force or the cost
// model (PathCosts, sluice/path_cost.hpp) makes per layer.
#include <string>

namespace sluice {

/// How the engine multiplies a layer: streamed sparse (every packet one AXPY), or dense
/// (the arriving packets scattered into dense tiles multiplied by oneDNN's matmul, AMX in
/// bf16 where the CPU has it; docs/dense_path.md). `automatic` asks the cost model
/// per layer. The stream is sparse either way.
enum class ProductPath { automatic, sparse, dense };
const char* to_string(ProductPath path);  ///< "auto", "sparse", "dense"
/// "auto", "sparse" or "dense"; ArgumentError otherwise.
ProductPath parse_product_path(const std::string& name);

}  // namespace sluice
