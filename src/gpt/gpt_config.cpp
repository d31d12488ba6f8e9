// A GPT's shape, where its parameters sit in ModelMemory, building a fresh one and reading
// one back from a ModelMemory.
#include <cmath>
#include <sstream>
#include <string>

#include "sluice/error.hpp"
#include "sluice/gpt.hpp"

namespace sluice {
namespace {

constexpr const char* kModelName = "gpt";
constexpr std::int64_t kMaxDimension = std::int64_t{1} << 20;

void check_range(const char* name, std::int64_t value, std::int64_t lowest) {
  if (value < lowest || value > kMaxDimension) {
    throw ArgumentError(std::string("gpt: ") + name + " " + std::to_string(value) +
                        " is outside [" + std::to_string(lowest) + ", 2^20]");
  }
}

/// A layer whose mask is full: every position of rows x cols stored, all `value`.
CsrMatrix full_layer(std::int64_t rows, std::int64_t cols, float value) {
  CsrMatrix w = CsrMatrix::random(rows, cols, 0.0, 1);
  for (float& v : w.values()) v = value;
  return w;
}

/// A projection: a seeded random mask, uniform values of variance `gain^2 / fan-in`.
CsrMatrix projection(std::int64_t rows, std::int64_t cols, double sparsity, std::uint64_t seed,
                     double gain) {
  CsrMatrix w = CsrMatrix::random(rows, cols, sparsity, seed);
  const double fan_in = std::max(1.0, (1.0 - sparsity) * static_cast<double>(cols));
  w.fill_values(seed ^ 0x9E3779B97F4A7C15ULL, static_cast<float>(gain * std::sqrt(3.0 / fan_in)));
  return w;
}

std::vector<float> zeros(std::int64_t n) {
  return std::vector<float>(static_cast<std::size_t>(n), 0.0F);
}

}  // namespace

void GptConfig::validate() const {
  check_range("vocab", vocab, 2);
  check_range("context", context, 1);
  check_range("d_model", d_model, 1);
  check_range("heads", heads, 1);
  check_range("blocks", blocks, 1);
  if (d_model % heads != 0) {
    throw ShapeError("gpt: d_model " + std::to_string(d_model) + " is not a multiple of heads " +
                     std::to_string(heads));
  }
  if (!(sparsity >= 0.0 && sparsity < 1.0)) {
    throw ArgumentError("gpt: sparsity " + std::to_string(sparsity) + " is outside [0, 1)");
  }
}

std::string GptConfig::describe() const {
  return std::string(kModelName) + " vocab=" + std::to_string(vocab) +
         " context=" + std::to_string(context) + " d_model=" + std::to_string(d_model) +
         " heads=" + std::to_string(heads) + " blocks=" + std::to_string(blocks);
}

GptConfig GptConfig::parse(const std::string& text) {
  std::istringstream in(text);
  std::string word;
  if (!(in >> word) || word != kModelName) {
    throw FormatError("gpt: the model '" + text + "' is not a GPT");
  }
  GptConfig c;
  c.sparsity = 0;
  std::int64_t* fields[] = {&c.vocab, &c.context, &c.d_model, &c.heads, &c.blocks};
  const char* names[] = {"vocab=", "context=", "d_model=", "heads=", "blocks="};
  for (int i = 0; i < 5; ++i) {
    const std::string name = names[i];
    if (!(in >> word) || word.rfind(name, 0) != 0) {
      throw FormatError("gpt: the model '" + text + "' lacks " + name);
    }
    try {
      std::size_t used = 0;
      *fields[i] = std::stoll(word.substr(name.size()), &used);
      if (used != word.size() - name.size()) throw std::invalid_argument(word);
    } catch (const std::exception&) {
      throw FormatError("gpt: the model '" + text + "' has a bad " + name);
    }
  }
  if (in >> word) throw FormatError("gpt: the model '" + text + "' has more after blocks=");
  try {
    c.validate();
  } catch (const ArgumentError& e) {
    throw FormatError(std::string(e.what()) + " (in the model '" + text + "')");
  }
  return c;
}

GptLayers::GptLayers(const GptConfig& config) {
  std::int32_t next = 2;  // after the token table and the positions
  for (std::int64_t b = 0; b < config.blocks; ++b) {
    Block block{};
    for (std::int32_t* l : {&block.norm1, &block.q, &block.k, &block.v, &block.o, &block.norm2,
                            &block.up, &block.down}) {
      *l = next++;
    }
    blocks.push_back(block);
  }
  final_norm = next++;
  head = next++;
  count = next;
}

std::vector<std::int32_t> GptLayers::sparse() const {
  std::vector<std::int32_t> out;
  for (const Block& b : blocks) {
    for (const std::int32_t l : {b.q, b.k, b.v, b.o, b.up, b.down}) out.push_back(l);
  }
  out.push_back(head);
  return out;
}

void build_gpt(ModelMemory& memory, const GptConfig& config, std::uint64_t seed) {
  config.validate();
  if (memory.layer_count() != 0) {
    throw ArgumentError("build_gpt: the ModelMemory already holds " +
                        std::to_string(memory.layer_count()) + " layers");
  }
  const std::int64_t d = config.d_model;
  const double s = config.sparsity;
  // The residual stream is a sum of 2 * blocks branches: their last projections start small
  // so that it stays of order one (as GPT-2 does).
  const double residual_gain = 1.0 / std::sqrt(2.0 * static_cast<double>(config.blocks));
  std::uint64_t layer_seed = seed * 1000003ULL;
  auto next_seed = [&] { return layer_seed += 7919; };

  CsrMatrix table = full_layer(config.vocab, d, 0.0F);
  table.fill_values(next_seed(), 0.1F);
  memory.add_layer(std::move(table));
  CsrMatrix positions = full_layer(config.context, d, 0.0F);
  positions.fill_values(next_seed(), 0.02F);
  memory.add_layer(std::move(positions));
  auto add_norm = [&] { memory.add_layer(full_layer(d, 1, 1.0F), zeros(d)); };
  auto add_projection = [&](std::int64_t rows, std::int64_t cols, double gain) {
    memory.add_layer(projection(rows, cols, s, next_seed(), gain), zeros(rows));
  };
  for (std::int64_t b = 0; b < config.blocks; ++b) {
    add_norm();
    for (int i = 0; i < 3; ++i) add_projection(d, d, 1.0);  // Q, K, V
    add_projection(d, d, residual_gain);                    // O
    add_norm();
    add_projection(4 * d, d, 1.0);
    add_projection(d, 4 * d, residual_gain);
  }
  add_norm();
  add_projection(config.vocab, d, 1.0);
  memory.model = config.describe();
}

std::vector<GptLayerShape> gpt_layer_shapes(const GptConfig& c) {
  const GptLayers layers(c);
  const std::int64_t d = c.d_model;
  std::vector<GptLayerShape> shapes(static_cast<std::size_t>(layers.count));
  auto set = [&](std::int32_t layer, std::int64_t rows, std::int64_t cols, bool bias, bool sparse) {
    shapes[static_cast<std::size_t>(layer)] = {rows, cols, bias, sparse};
  };
  set(layers.table, c.vocab, d, false, false);
  set(layers.positions, c.context, d, false, false);
  for (const GptLayers::Block& b : layers.blocks) {
    set(b.norm1, d, 1, true, false);
    for (std::int32_t l : {b.q, b.k, b.v, b.o}) set(l, d, d, true, true);
    set(b.norm2, d, 1, true, false);
    set(b.up, 4 * d, d, true, true);
    set(b.down, d, 4 * d, true, true);
  }
  set(layers.final_norm, d, 1, true, false);
  set(layers.head, c.vocab, d, true, true);
  return shapes;
}

GptConfig gpt_config_of(const ModelMemory& memory) {
  GptConfig c = GptConfig::parse(memory.model);
  const std::vector<GptLayerShape> shapes = gpt_layer_shapes(c);
  if (memory.layer_count() != static_cast<std::int32_t>(shapes.size())) {
    throw FormatError("gpt: " + c.describe() + " has " + std::to_string(shapes.size()) +
                      " layers, the ModelMemory " + std::to_string(memory.layer_count()));
  }
  double nnz = 0, positions = 0;
  for (std::int32_t layer = 0; layer < memory.layer_count(); ++layer) {
    const GptLayerShape& want = shapes[static_cast<std::size_t>(layer)];
    const LayerShape w = memory.layer_shape(layer);
    if (w.rows != want.rows || w.cols != want.cols || (w.bias != 0) != want.bias) {
      throw FormatError("gpt: layer " + std::to_string(layer) + " is " + std::to_string(w.rows) +
                        "x" + std::to_string(w.cols) + " (bias " + std::to_string(w.bias) + "), " +
                        c.describe() + " wants " + std::to_string(want.rows) + "x" +
                        std::to_string(want.cols));
    }
    if (want.sparse) {
      nnz += static_cast<double>(w.nnz);
      positions += static_cast<double>(w.rows * w.cols);
    } else if (w.nnz != w.rows * w.cols) {
      throw FormatError("gpt: dense parameter layer " + std::to_string(layer) + " is not dense");
    }
  }
  c.sparsity = 1.0 - nnz / positions;
  return c;
}

std::int64_t gpt_parameters(const GptConfig& c) {
  const std::int64_t d = c.d_model;
  const std::int64_t per_block =
      2 * 2 * d + 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  return c.vocab * d + c.context * d + c.blocks * per_block + 2 * d + c.vocab * d + c.vocab;
}

std::int64_t stored_parameters(const ModelMemory& memory) {
  std::int64_t n = 0;
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
    const LayerShape w = memory.layer_shape(l);
    n += w.nnz + w.bias;
  }
  return n;
}

}  // namespace sluice
