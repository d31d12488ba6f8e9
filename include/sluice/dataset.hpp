#pragma once
// Labelled data sets for training and evaluation: features x samples (one sample per
// column, as the engines want tokens), integer class labels.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sluice/dense.hpp"

namespace sluice {

struct Dataset {
  DenseMatrix features;     ///< features x samples
  std::vector<int> labels;  ///< one per sample, in [0, classes)
  int classes = 0;
  /// A CSV's class names, class i the i-th; empty where the labels are numbers.
  std::vector<std::string> class_names;
  std::int64_t samples() const { return features.cols(); }
};

/// Reads a CSV of numbers, one sample per line, the last column its label: an integer in
/// [0, 1e6], or a class name (when any label is not a number, every label is a name and
/// the classes are the names in sorted order); gzip'd files are read transparently, and a
/// UTF-8 byte order mark before the first cell is skipped. A cell may be in double quotes.
/// A first line of names (no cell a number) is a header and skipped. Every row must have
/// as many columns as the first. Blank lines are skipped. FormatError names the file,
/// line and column of a bad row; IoError if the file cannot be opened.
Dataset load_csv(const std::filesystem::path& path);
/// The line (from 1) of `path` that load_csv reads sample `sample` (from 0) from, for
/// messages; ArgumentError past the last sample.
std::int64_t csv_line_of(const std::filesystem::path& path, std::int64_t sample);

/// The UCI optical-digits set as scikit-learn ships it (sklearn/datasets/data/
/// digits.csv.gz: 1797 rows, 64 pixel values 0..16, then the label 0..9).
/// FormatError unless the file has that shape.
Dataset load_digits(const std::filesystem::path& path);

/// Numbers `data`'s named classes as `names` does (a resumed model's classes, in
/// ModelMemory::class_names): the i-th of `names` becomes class i, and `data.classes` and
/// `data.class_names` those of `names`, whichever of them the data holds. FormatError
/// naming the first sample of a class not among `names` (`where(sample)` names it, e.g. by
/// its line; default "sample N"), or data whose classes are numbers.
void renumber_classes(Dataset& data, const std::vector<std::string>& names,
                      const std::function<std::string(std::int64_t)>& where = {});

/// Where the digits file is: `explicit_path` if given, else $SLUICE_DIGITS, else the
/// first of these that exists:
///   $XDG_DATA_HOME/sluice/digits.csv.gz (or ~/.local/share/sluice/digits.csv.gz),
///   data/digits.csv.gz beside the running program (where scripts/sluice-setup puts it),
///   /usr/local/share/sluice/digits.csv.gz, /usr/share/sluice/digits.csv.gz,
///   /usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz (python3-sklearn).
std::optional<std::filesystem::path> find_digits_file(
    const std::optional<std::filesystem::path>& explicit_path = std::nullopt);

/// A teacher-student task: Gaussian inputs labelled by the argmax of a random sparse
/// two-layer ReLU teacher network (features -> 4*classes hidden -> classes). Seeded: the
/// same arguments give the same data.
Dataset make_synthetic_dataset(std::int64_t samples, std::int64_t features, int classes,
                               std::uint64_t seed);

/// A fixed held-out split: a seeded shuffle, then the first round(test_fraction * n)
/// samples are the test set. Returns {train, test}.
std::pair<Dataset, Dataset> split_dataset(const Dataset& data, double test_fraction,
                                          std::uint64_t seed);

/// Per feature, a standardisation: x' = (x - mean) * scale.
struct FeatureScaling {
  std::vector<double> mean, scale;
};
/// What scales each of `train`'s features to mean 0, standard deviation 1 (a constant
/// feature is only centred: scale 1).
FeatureScaling feature_scaling(const Dataset& train);
/// Scales `data`'s features by `s` (as another set's were, e.g. a model's training set's);
/// ShapeError unless `s` has a mean and a scale per feature.
void scale_features(Dataset& data, const FeatureScaling& s);
/// Scales every feature to mean 0, standard deviation 1 using the training set's
/// statistics, applied to both sets (constant features are only centred).
void standardize(Dataset& train, Dataset& test);

/// The samples [begin, end) of a data set as a view, and their labels.
ConstMatrixView sample_view(const Dataset& data, std::int64_t begin, std::int64_t end);

}  // namespace sluice
