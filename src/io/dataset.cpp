// Data sets: CSV (plain or gzip'd, through zlib), the digits file, a synthetic
// teacher-student task, a seeded split and standardization.
#include "sluice/dataset.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <unordered_map>

#include "core/excerpt.hpp"
#include "core/input_file.hpp"
#include "core/splitmix.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

std::string where(const std::filesystem::path& path, std::int64_t line) {
  return path.string() + ":" + std::to_string(line);
}

// Every line of a plain or gzip'd file.
std::vector<std::string> read_lines(const std::filesystem::path& path) {
  const std::string text = detail::read_maybe_gzipped_bytes(path);
  std::vector<std::string> lines;
  // A UTF-8 byte order mark, as spreadsheets write before a CSV's first cell, is not text.
  constexpr std::string_view kByteOrderMark = "\xEF\xBB\xBF";
  std::size_t start = text.starts_with(kByteOrderMark) ? kByteOrderMark.size() : 0;
  while (start <= text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    start = end + 1;
  }
  return lines;
}

Dataset subset(const Dataset& data, const std::vector<std::int64_t>& order, std::size_t begin,
               std::size_t end) {
  Dataset out;
  out.classes = data.classes;
  out.class_names = data.class_names;
  out.features = DenseMatrix(data.features.rows(), static_cast<std::int64_t>(end - begin));
  for (std::size_t j = begin; j < end; ++j) {
    const std::int64_t src = order[j];
    const auto dst = static_cast<std::int64_t>(j - begin);
    for (std::int64_t f = 0; f < data.features.rows(); ++f)
      out.features(f, dst) = data.features(f, src);
    out.labels.push_back(data.labels[static_cast<std::size_t>(src)]);
  }
  return out;
}

std::string trimmed(std::string_view text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  return std::string(text.substr(first, text.find_last_not_of(" \t") - first + 1));
}

/// The line's comma-separated cells, blanks around each trimmed. A cell in double quotes,
/// as spreadsheets and Python's csv module write them, may hold commas, and "" in it is
/// one quote.
std::vector<std::string> cells_of(const std::string& line) {
  std::vector<std::string> cells;
  std::size_t i = 0;
  while (true) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    std::string cell;
    if (i < line.size() && line[i] == '"') {
      for (++i; i < line.size(); ++i) {
        if (line[i] != '"') {
          cell += line[i];
        } else if (i + 1 < line.size() && line[i + 1] == '"') {
          cell += line[++i];
        } else {
          ++i;  // the closing quote
          break;
        }
      }
    }
    const std::size_t end = std::min(line.find(',', i), line.size());
    cell += trimmed(std::string_view(line).substr(i, end - i));
    cells.push_back(std::move(cell));
    if (end == line.size()) return cells;
    i = end + 1;
  }
}

/// The cell as a finite number, or nullopt.
std::optional<double> number_of(const std::string& cell) {
  double v = 0;
  const auto [ptr, ec] = std::from_chars(cell.data(), cell.data() + cell.size(), v);
  if (cell.empty() || ec != std::errc() || ptr != cell.data() + cell.size() || !std::isfinite(v))
    return std::nullopt;
  return v;
}

/// A row's features: every cell but the last, its label. FormatError says which is wrong.
std::vector<double> features_of(const std::vector<std::string>& cells, const std::string& at) {
  if (cells.size() < 2) {
    throw FormatError(at + ": one column, " + detail::excerpt(cells.front()) +
                      ": a sample needs features and a label, separated by commas");
  }
  std::vector<double> values;
  for (std::size_t c = 0; c + 1 < cells.size(); ++c) {
    const std::string& cell = cells[c];
    const std::string column = "column " + std::to_string(c + 1);
    const std::optional<double> v = number_of(cell);
    if (!v)
      throw FormatError(at + ": " + column + " is not a finite number: " + detail::excerpt(cell));
    // Features are held in fp32: a larger value would become infinite there.
    if (std::fabs(*v) > std::numeric_limits<float>::max())
      throw FormatError(at + ": " + column +
                        " is outside the fp32 range: " + detail::excerpt(cell));
    values.push_back(*v);
  }
  return values;
}

constexpr int kMostClasses = 1000000;

/// The samples' labels from their label cells (`where(i)` names sample i's line):
/// integers in [0, 1e6] as given, or class names, numbered in sorted order into `names`.
/// Numbers and names mixed are refused (a typo among class numbers would otherwise renumber
/// every class). FormatError names the line of a bad one.
std::vector<int> labels_of(const std::vector<std::string>& cells,
                           const std::function<std::string(std::size_t)>& where,
                           std::vector<std::string>& names) {
  std::vector<int> labels(cells.size());
  std::vector<std::optional<double>> numbers(cells.size());
  std::optional<std::size_t> a_number, a_name;
  for (std::size_t i = 0; i < cells.size(); ++i) {
    if (cells[i].empty()) throw FormatError(where(i) + ": the label is empty");
    numbers[i] = number_of(cells[i]);
    (numbers[i] ? a_number : a_name).emplace(i);
    if (a_number && a_name) {
      throw FormatError(where(i) + ": label " + detail::excerpt(cells[i]) + " is a " +
                        (numbers[i] ? "number" : "name") + ", but " +
                        where(numbers[i] ? *a_name : *a_number) + "'s is a " +
                        (numbers[i] ? "name" : "number") +
                        ": the labels must be class numbers or class names, not both");
    }
  }
  if (!a_name) {
    for (std::size_t i = 0; i < cells.size(); ++i) {
      const double label = *numbers[i];
      if (label < 0 || label != std::floor(label) || label > kMostClasses) {
        char shown[32];
        std::snprintf(shown, sizeof shown, "%.6g", label);
        throw FormatError(where(i) + ": label " + shown + " is not an integer in [0, 1e6]");
      }
      labels[i] = static_cast<int>(label);
    }
    return labels;
  }
  names = cells;
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  if (names.size() > static_cast<std::size_t>(kMostClasses)) {
    throw FormatError(where(cells.size() - 1) + ": the labels name " +
                      std::to_string(names.size()) + " classes, more than 1e6");
  }
  for (std::size_t i = 0; i < cells.size(); ++i) {
    labels[i] =
        static_cast<int>(std::lower_bound(names.begin(), names.end(), cells[i]) - names.begin());
  }
  return labels;
}

bool blank(const std::string& line) {
  return line.find_first_not_of(" \t") == std::string::npos;
}

/// Where a CSV's samples are: every line not blank, but for a header, a first line of
/// names alone (no cell a number) as most tools write one, which sets the column count.
struct CsvLines {
  std::size_t header_columns = 0;    ///< 0: no header
  std::vector<std::size_t> samples;  ///< indices of the sample lines
};
CsvLines csv_lines(const std::vector<std::string>& lines) {
  CsvLines out;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (blank(lines[i])) continue;
    if (out.samples.empty() && out.header_columns == 0) {
      const std::vector<std::string> cells = cells_of(lines[i]);
      if (std::none_of(cells.begin(), cells.end(),
                       [](const std::string& c) { return number_of(c).has_value(); })) {
        out.header_columns = cells.size();
        continue;
      }
    }
    out.samples.push_back(i);
  }
  return out;
}

}  // namespace

Dataset load_csv(const std::filesystem::path& path) {
  const std::vector<std::string> lines = read_lines(path);
  std::vector<std::vector<double>> rows;
  std::vector<std::string> label_cells;
  const CsvLines csv = csv_lines(lines);
  std::size_t columns = csv.header_columns;
  for (const std::size_t i : csv.samples) {
    const std::string at = where(path, static_cast<std::int64_t>(i + 1));
    std::vector<std::string> cells = cells_of(lines[i]);
    std::vector<double> features = features_of(cells, at);  // a bad value said first
    if (columns == 0) columns = cells.size();
    if (cells.size() != columns) {
      throw FormatError(at + ": " + std::to_string(cells.size()) + " columns, expected " +
                        std::to_string(columns));
    }
    rows.push_back(std::move(features));
    label_cells.push_back(std::move(cells.back()));
  }
  if (rows.empty()) throw FormatError(path.string() + ": no data rows");
  Dataset d;
  d.labels = labels_of(
      label_cells,
      [&](std::size_t i) { return where(path, static_cast<std::int64_t>(csv.samples[i] + 1)); },
      d.class_names);
  d.features =
      DenseMatrix(static_cast<std::int64_t>(columns - 1), static_cast<std::int64_t>(rows.size()));
  for (std::size_t s = 0; s < rows.size(); ++s) {
    for (std::size_t f = 0; f + 1 < columns; ++f) {
      d.features(static_cast<std::int64_t>(f), static_cast<std::int64_t>(s)) =
          static_cast<float>(rows[s][f]);
    }
  }
  d.classes = *std::max_element(d.labels.begin(), d.labels.end()) + 1;
  return d;
}

void renumber_classes(Dataset& data, const std::vector<std::string>& names,
                      const std::function<std::string(std::int64_t)>& where) {
  const auto sample_name = [&](std::int64_t sample) {
    return where ? where(sample) : "sample " + std::to_string(sample);
  };
  if (names.empty()) throw ArgumentError("renumber_classes: no class names to number by");
  if (data.class_names.empty()) {
    throw FormatError("the labels are class numbers, where the classes are named (" +
                      detail::excerpt(names.front()) + " is class 0)");
  }
  std::unordered_map<std::string_view, int> number;
  for (std::size_t c = 0; c < names.size(); ++c) number.emplace(names[c], static_cast<int>(c));
  std::vector<int> renumbered(data.class_names.size(), -1);
  for (std::size_t c = 0; c < data.class_names.size(); ++c) {
    const auto found = number.find(data.class_names[c]);
    if (found != number.end()) renumbered[c] = found->second;
  }
  std::vector<int> labels(data.labels.size());  // `data` is left as it was if one is refused
  for (std::size_t i = 0; i < labels.size(); ++i) {
    const int label = renumbered[static_cast<std::size_t>(data.labels[i])];
    if (label < 0) {
      throw FormatError(
          sample_name(static_cast<std::int64_t>(i)) + ": class " +
          detail::excerpt(data.class_names[static_cast<std::size_t>(data.labels[i])]) +
          " is not one of the " + std::to_string(names.size()) + " classes named");
    }
    labels[i] = label;
  }
  data.labels = std::move(labels);
  data.classes = static_cast<int>(names.size());
  data.class_names = names;
}

std::int64_t csv_line_of(const std::filesystem::path& path, std::int64_t sample) {
  const std::vector<std::size_t> samples = csv_lines(read_lines(path)).samples;
  if (sample < 0 || static_cast<std::size_t>(sample) >= samples.size()) {
    throw ArgumentError(path.string() + " has no sample " + std::to_string(sample));
  }
  return static_cast<std::int64_t>(samples[static_cast<std::size_t>(sample)] + 1);
}

Dataset load_digits(const std::filesystem::path& path) {
  Dataset d = load_csv(path);
  if (d.features.rows() != 64 || d.classes > 10) {
    throw FormatError(path.string() +
                      ": not the digits set (expected 64 pixel columns and labels 0..9, got " +
                      std::to_string(d.features.rows()) + " features and " +
                      std::to_string(d.classes) + " classes)");
  }
  d.classes = 10;
  return d;
}

std::optional<std::filesystem::path> find_digits_file(
    const std::optional<std::filesystem::path>& explicit_path) {
  if (explicit_path) return explicit_path;
  if (const char* env = std::getenv("SLUICE_DIGITS"); env != nullptr && *env != '\0') {
    return std::filesystem::path(env);
  }
  std::vector<std::filesystem::path> candidates;
  if (const char* xdg = std::getenv("XDG_DATA_HOME"); xdg != nullptr && *xdg != '\0') {
    candidates.emplace_back(std::filesystem::path(xdg) / "sluice/digits.csv.gz");
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    candidates.emplace_back(std::filesystem::path(home) / ".local/share/sluice/digits.csv.gz");
  }
  // Beside the running program: scripts/sluice-setup puts it in <build>/data/.
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.emplace_back(exe.parent_path() / "data/digits.csv.gz");
  candidates.emplace_back("/usr/local/share/sluice/digits.csv.gz");
  candidates.emplace_back("/usr/share/sluice/digits.csv.gz");
  candidates.emplace_back("/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz");
  for (const auto& c : candidates) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(c, ec)) return c;
  }
  return std::nullopt;
}

Dataset make_synthetic_dataset(std::int64_t samples, std::int64_t features, int classes,
                               std::uint64_t seed) {
  // The teacher network is features x 4*classes x classes, held densely.
  constexpr std::int64_t kMaxSide = std::int64_t{1} << 24;
  if (samples < 1 || features < 1 || classes < 2 || samples > kMaxSide || features > kMaxSide ||
      classes > kMaxSide / 4) {
    throw ArgumentError(
        "synthetic data set: needs 1 <= samples, features <= 2^24 and 2 <= classes "
        "<= 2^22, got " +
        std::to_string(samples) + ", " + std::to_string(features) + ", " + std::to_string(classes));
  }
  const std::int64_t hidden = 4 * classes;
  const double density = std::min(1.0, 8.0 / static_cast<double>(features));
  const DenseMatrix w1 =
      CsrMatrix::random(hidden, features, std::max(0.0, 1.0 - std::max(density, 0.5)), seed + 1)
          .to_dense();
  const DenseMatrix w2 = CsrMatrix::random(classes, hidden, 0.5, seed + 2).to_dense();
  Dataset d;
  d.classes = classes;
  d.features = DenseMatrix(features, samples);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::int64_t s = 0; s < samples; ++s) {
    for (std::int64_t f = 0; f < features; ++f) d.features(f, s) = normal(rng);
  }
  std::vector<double> h(static_cast<std::size_t>(hidden));
  for (std::int64_t s = 0; s < samples; ++s) {
    for (std::int64_t j = 0; j < hidden; ++j) {
      double acc = 0;
      for (std::int64_t f = 0; f < features; ++f) acc += w1(j, f) * d.features(f, s);
      h[static_cast<std::size_t>(j)] = std::max(0.0, acc);
    }
    int best = 0;
    double peak = -1e300;
    for (int c = 0; c < classes; ++c) {
      double acc = 0;
      for (std::int64_t j = 0; j < hidden; ++j) acc += w2(c, j) * h[static_cast<std::size_t>(j)];
      if (acc > peak) {
        peak = acc;
        best = c;
      }
    }
    d.labels.push_back(best);
  }
  return d;
}

std::pair<Dataset, Dataset> split_dataset(const Dataset& data, double test_fraction,
                                          std::uint64_t seed) {
  if (!(test_fraction >= 0 && test_fraction < 1)) {
    throw ArgumentError("split_dataset: test fraction must be in [0, 1), got " +
                        std::to_string(test_fraction));
  }
  if (static_cast<std::int64_t>(data.labels.size()) != data.samples()) {
    throw ShapeError("split_dataset: " + std::to_string(data.labels.size()) + " labels for " +
                     std::to_string(data.samples()) + " samples");
  }
  const auto n = static_cast<std::size_t>(data.samples());
  std::vector<std::int64_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<std::int64_t>(i);
  std::uint64_t state = seed;
  for (std::size_t i = n; i > 1; --i) {  // Fisher-Yates, own generator: same split everywhere
    state = detail::splitmix64(state);
    std::swap(order[i - 1], order[state % i]);
  }
  const auto test_n =
      static_cast<std::size_t>(std::llround(test_fraction * static_cast<double>(n)));
  Dataset test = subset(data, order, 0, test_n);
  Dataset train = subset(data, order, test_n, n);
  return {std::move(train), std::move(test)};
}

FeatureScaling feature_scaling(const Dataset& train) {
  const std::int64_t n = train.samples();
  FeatureScaling s;
  for (std::int64_t f = 0; f < train.features.rows(); ++f) {
    double sum = 0, sq = 0;
    for (std::int64_t i = 0; i < n; ++i) sum += train.features(f, i);
    const double mean = n > 0 ? sum / static_cast<double>(n) : 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double d = train.features(f, i) - mean;
      sq += d * d;
    }
    const double sd = n > 0 ? std::sqrt(sq / static_cast<double>(n)) : 0;
    s.mean.push_back(mean);
    s.scale.push_back(sd > 1e-12 ? 1.0 / sd : 1.0);
  }
  return s;
}

void scale_features(Dataset& data, const FeatureScaling& s) {
  const auto features = static_cast<std::size_t>(data.features.rows());
  if (s.mean.size() != features || s.scale.size() != features) {
    throw ShapeError("scale_features: " + std::to_string(s.mean.size()) + " means and " +
                     std::to_string(s.scale.size()) + " scales for " + std::to_string(features) +
                     " features");
  }
  for (std::int64_t f = 0; f < data.features.rows(); ++f) {
    const double mean = s.mean[static_cast<std::size_t>(f)];
    const double scale = s.scale[static_cast<std::size_t>(f)];
    for (std::int64_t i = 0; i < data.samples(); ++i) {
      data.features(f, i) = static_cast<float>((data.features(f, i) - mean) * scale);
    }
  }
}

void standardize(Dataset& train, Dataset& test) {
  if (test.samples() > 0 && test.features.rows() != train.features.rows()) {
    throw ShapeError("standardize: train and test have different feature counts");
  }
  const FeatureScaling s = feature_scaling(train);
  scale_features(train, s);
  if (test.samples() > 0) scale_features(test, s);
}

ConstMatrixView sample_view(const Dataset& data, std::int64_t begin, std::int64_t end) {
  if (begin < 0 || end < begin || end > data.samples()) {
    throw ArgumentError("sample_view: [" + std::to_string(begin) + ", " + std::to_string(end) +
                        ") is outside " + std::to_string(data.samples()) + " samples");
  }
  return {data.features.data() + begin, data.features.rows(), end - begin, data.features.stride()};
}

}  // namespace sluice
