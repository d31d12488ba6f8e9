// The Engine's public calls: every shape and argument is checked here, once, before an
// implementation runs.
#include "sluice/engine.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <sstream>
#include <string>

#include "core/enum_names.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

std::string shape(std::int64_t r, std::int64_t c) {
  return std::to_string(r) + "x" + std::to_string(c);
}

template <typename T>
void check_view(const MatrixView<T>& v, const char* name) {
  if (v.rows < 0 || v.cols < 0 || v.stride < v.cols) {
    throw ShapeError(std::string(name) + ": bad view " + shape(v.rows, v.cols) + " with stride " +
                     std::to_string(v.stride));
  }
  if (v.data == nullptr && v.rows > 0 && v.cols > 0) {
    throw ShapeError(std::string(name) + ": null data for a " + shape(v.rows, v.cols) + " view");
  }
}

/// Whether two views share an element. Views with one stride are checked exactly, so
/// side-by-side column blocks of one buffer ([X | Y] rows) pass; others by their spans.
template <typename A, typename B>
bool overlap(const MatrixView<A>& a, const MatrixView<B>& b) {
  if (a.rows == 0 || a.cols == 0 || b.rows == 0 || b.cols == 0) return false;
  const auto* a0 = reinterpret_cast<const char*>(a.data);
  const auto* a1 = reinterpret_cast<const char*>(a.data + (a.rows - 1) * a.stride + a.cols);
  const auto* b0 = reinterpret_cast<const char*>(b.data);
  const auto* b1 = reinterpret_cast<const char*>(b.data + (b.rows - 1) * b.stride + b.cols);
  if (!(a0 < b1 && b0 < a1)) return false;
  const std::ptrdiff_t bytes = b0 - a0;
  if (a.stride != b.stride || bytes % static_cast<std::ptrdiff_t>(sizeof(float)) != 0) return true;
  // With the lower view as `lo`, the other starts q rows and m columns further on
  // (0 <= m < stride): its columns [m, m + cols) fall in the lower one's rows q + r, and
  // those past the stride wrap into rows q + r + 1 from column 0.
  const std::ptrdiff_t d = bytes / static_cast<std::ptrdiff_t>(sizeof(float));
  const bool a_first = d >= 0;
  const std::int64_t lo_rows = a_first ? a.rows : b.rows, lo_cols = a_first ? a.cols : b.cols;
  const std::int64_t hi_cols = a_first ? b.cols : a.cols;
  const std::int64_t s = a.stride, q = std::abs(d) / s, m = std::abs(d) % s;
  return (m < lo_cols && q < lo_rows) || (m + hi_cols > s && q + 1 < lo_rows);
}

void check_placement(const Placement& placement, std::int64_t features, const char* what) {
  if (placement.lanes < 1 || placement.features() != features ||
      static_cast<std::int64_t>(placement.lane_nnz.size()) != placement.lanes) {
    throw ShapeError(std::string(what) + " is for " + std::to_string(placement.features()) +
                     " features on " + std::to_string(placement.lanes) + " lanes; the layer has " +
                     std::to_string(features) + " features");
  }
  // A placement is a public struct a caller may fill in by hand; the engine indexes its
  // lanes with these values.
  const auto bad =
      std::find_if(placement.lane_of.begin(), placement.lane_of.end(),
                   [&](std::int32_t lane) { return lane < 0 || lane >= placement.lanes; });
  if (bad != placement.lane_of.end()) {
    throw ShapeError(std::string(what) + " puts feature " +
                     std::to_string(bad - placement.lane_of.begin()) + " on lane " +
                     std::to_string(*bad) + ", outside its " + std::to_string(placement.lanes) +
                     " lanes");
  }
}

void check_layer(const StreamHeader& h, const Placement& placement, ConstMatrixView x) {
  check_view(x, "X");
  if (h.inputs != x.rows) {
    throw ShapeError("stream is for a layer with " + std::to_string(h.inputs) +
                     " inputs but X has " + std::to_string(x.rows) + " rows");
  }
  check_placement(placement, h.inputs, "placement");
}

}  // namespace

std::string Geometry::to_string() const {
  std::ostringstream s;
  s << lanes << "x" << blocks;
  if (shares > 1) s << "x" << shares;
  s << "/" << tile_tokens;
  return s.str();
}

void Engine::forward(StreamSource& weights, const Placement& placement, ConstMatrixView x,
                     MutableMatrixView y, const Placement* next_placement) {
  const StreamHeader& h = weights.header();
  if (h.kind != StreamKind::weights) {
    throw ArgumentError(std::string("forward needs a weights stream, got a ") + to_string(h.kind) +
                        " stream");
  }
  if (h.order != StreamOrder::by_output) {
    throw ArgumentError(std::string("forward needs a stream by output, got one ") +
                        to_string(h.order));
  }
  check_layer(h, placement, x);
  check_view(y, "Y");
  if (h.outputs != y.rows || x.cols != y.cols) {
    throw ShapeError("Y is " + shape(y.rows, y.cols) + ", expected " + shape(h.outputs, x.cols));
  }
  if (overlap(x, y)) throw ArgumentError("X and Y overlap in memory");
  if (next_placement != nullptr)
    check_placement(*next_placement, h.outputs, "next layer's placement");
  forward_impl(weights, placement, x, y, next_placement);
}

namespace {

void check_backward(const StreamHeader& h, const Placement& placement, std::int64_t inputs,
                    std::int64_t tokens, ConstMatrixView dy, MutableMatrixView* dx) {
  if (h.order != StreamOrder::by_output && h.order != StreamOrder::by_input) {
    throw ArgumentError("stream of unknown order " +
                        std::to_string(static_cast<std::uint32_t>(h.order)));
  }
  // The layer's shape, whichever way the stream walks it.
  const std::int64_t layer_inputs = h.layer_inputs(), layer_outputs = h.layer_outputs();
  check_placement(placement, layer_inputs, "placement");
  if (layer_inputs != inputs) {
    throw ShapeError("stream is for a layer with " + std::to_string(layer_inputs) +
                     " inputs but the activations have " + std::to_string(inputs) + " rows");
  }
  check_view(dy, "dY");
  if (layer_outputs != dy.rows || dy.cols != tokens) {
    throw ShapeError("dY is " + shape(dy.rows, dy.cols) + ", expected " +
                     shape(layer_outputs, tokens));
  }
  if (dx != nullptr) {
    check_view(*dx, "dX");
    if (dx->rows != inputs || dx->cols != tokens) {
      throw ShapeError("dX is " + shape(dx->rows, dx->cols) + ", expected " +
                       shape(inputs, tokens));
    }
    if (overlap(*dx, dy)) throw ArgumentError("dX overlaps dY in memory");
  }
}

void check_kind(const StreamHeader& h, bool need_values) {
  if (h.kind == StreamKind::gradient || (need_values && h.kind != StreamKind::weights)) {
    throw ArgumentError(std::string("this backward pass needs a ") +
                        (need_values ? "weights" : "weights or mask") + " stream, got a " +
                        to_string(h.kind) + " stream");
  }
}

}  // namespace

WeightStream Engine::backward(StreamSource& weights, const Placement& placement, ConstMatrixView x,
                              ConstMatrixView dy, MutableMatrixView* dx) {
  const StreamHeader& h = weights.header();
  check_kind(h, dx != nullptr);
  check_view(x, "X");
  check_backward(h, placement, x.rows, x.cols, dy, dx);
  if (dx != nullptr && overlap(*dx, x)) throw ArgumentError("dX overlaps X in memory");
  return backward_impl(weights, placement, &x, dy, dx);
}

void Engine::backward_data(StreamSource& weights, const Placement& placement, ConstMatrixView dy,
                           MutableMatrixView dx) {
  const StreamHeader& h = weights.header();
  check_kind(h, true);
  check_backward(h, placement, dx.rows, dy.cols, dy, &dx);
  backward_impl(weights, placement, nullptr, dy, &dx);
}

}  // namespace sluice

namespace sluice {

constexpr detail::EnumName<ProductPath> kProductPathNames[] = {{ProductPath::automatic, "auto"},
                                                               {ProductPath::sparse, "sparse"},
                                                               {ProductPath::dense, "dense"}};

SLUICE_ENUM_NAMES(ProductPath, kProductPathNames, parse_product_path, "path")

}  // namespace sluice
