// Data sets: CSV (plain and gzip'd), the digits shape check, errors with line numbers,
// the seeded synthetic task, the fixed split and standardization.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "sluice/dataset.hpp"
#include "sluice/error.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

// Files go in a directory of the test's own, removed when it ends.
class DatasetFiles : public testing::TempDirTest {
 protected:
  std::filesystem::path temp(const std::string& name) const { return dir_ / name; }
};

void write(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

TEST_F(DatasetFiles, ReadsPlainAndGzippedCsv) {
  const std::string text = "1,2,3,0\n4,5,6,2\n\n7, 8 ,9,1\n";
  write(temp("plain.csv"), text);
  gzFile gz = gzopen(temp("packed.csv.gz").c_str(), "wb");
  ASSERT_NE(gz, nullptr);
  gzwrite(gz, text.data(), static_cast<unsigned>(text.size()));
  gzclose(gz);
  for (const char* name : {"plain.csv", "packed.csv.gz"}) {
    const Dataset d = load_csv(temp(name));
    ASSERT_EQ(d.features.rows(), 3);
    ASSERT_EQ(d.samples(), 3);
    EXPECT_EQ(d.classes, 3);
    EXPECT_EQ(d.labels, (std::vector<int>{0, 2, 1}));
    EXPECT_EQ(d.features(1, 2), 8.0F);
    EXPECT_EQ(d.features(2, 1), 6.0F);
  }
}

// A first line of names is a header: skipped, its column count kept. A line of names
// anywhere else, or a first line with a number among names, is a bad row.
TEST_F(DatasetFiles, AFirstLineOfNamesIsAHeader) {
  write(temp("header.csv"), "\n width, height ,label\n1,2,0\n3,4,1\n");
  const Dataset d = load_csv(temp("header.csv"));
  EXPECT_EQ(d.samples(), 2);
  EXPECT_EQ(d.labels, (std::vector<int>{0, 1}));
  EXPECT_EQ(d.features(1, 1), 4.0F);
  EXPECT_EQ(csv_line_of(temp("header.csv"), 1), 4);  // for messages: the file's own lines
  EXPECT_THROW(csv_line_of(temp("header.csv"), 2), ArgumentError);
  write(temp("short_header.csv"), "a,b\n1,2,0\n");
  write(temp("late_header.csv"), "1,2,0\na,b,c\n");
  write(temp("mixed_header.csv"), "a,2,label\n1,2,0\n");
  write(temp("header_only.csv"), "a,b,label\n");
  for (const auto& [name, message] : {std::pair{"short_header.csv", ":2: 3 columns, expected 2"},
                                      std::pair{"late_header.csv", ":2: column 1 is not"},
                                      std::pair{"mixed_header.csv", ":1: column 1 is not"},
                                      std::pair{"header_only.csv", "no data rows"}}) {
    try {
      load_csv(temp(name));
      ADD_FAILURE() << name;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

// A spreadsheet's "CSV UTF-8" begins with a byte order mark: not part of the first cell,
// with a header or without. One elsewhere is a cell's text (and refused as a number).
TEST_F(DatasetFiles, AByteOrderMarkBeforeTheFirstCellIsSkipped) {
  write(temp("bom.csv"),
        "\xEF\xBB\xBF"
        "5.1,3.5,setosa\n6.2,2.9,versicolor\n");
  const Dataset d = load_csv(temp("bom.csv"));
  ASSERT_EQ(d.samples(), 2);
  EXPECT_EQ(d.features(0, 0), 5.1F);
  EXPECT_EQ(d.class_names, (std::vector<std::string>{"setosa", "versicolor"}));
  write(temp("bom_header.csv"),
        "\xEF\xBB\xBF"
        "sepal,petal,species\n5.1,3.5,setosa\n");
  EXPECT_EQ(load_csv(temp("bom_header.csv")).samples(), 1);
  write(temp("bom_later.csv"),
        "5.1,3.5,0\n\xEF\xBB\xBF"
        "6.2,2.9,1\n");
  EXPECT_THROW(load_csv(temp("bom_later.csv")), FormatError);
}

// Labels that are names (iris's species) number the classes in sorted order; a cell in
// double quotes, as spreadsheets and Python's csv module write them, is read without them.
TEST_F(DatasetFiles, LabelsMayBeClassNamesAndCellsQuoted) {
  write(temp("iris.csv"),
        "\"sepal, cm\",\"petal\",\"species\"\n"
        "5.1,\"1.4\",setosa\n6.3, \"4.9\" ,\"virginica\"\n5.9,4.2,versicolor\n"
        "4.9,1.5,setosa\n6.0,5.0,\"Iris \"\"x\"\", y\"\n");
  const Dataset d = load_csv(temp("iris.csv"));
  ASSERT_EQ(d.samples(), 5);
  EXPECT_EQ(d.features.rows(), 2);
  EXPECT_EQ(d.features(1, 1), 4.9F);
  EXPECT_EQ(d.class_names,
            (std::vector<std::string>{"Iris \"x\", y", "setosa", "versicolor", "virginica"}));
  EXPECT_EQ(d.classes, 4);
  EXPECT_EQ(d.labels, (std::vector<int>{1, 3, 2, 1, 0}));
  const auto [train, test] = split_dataset(d, 0.4, 1);
  EXPECT_EQ(train.class_names, d.class_names);
  EXPECT_EQ(test.class_names, d.class_names);

  // Numbers alone stay the classes they say; mixed with names, they are refused.
  write(temp("numbers.csv"), "1,\"2\"\n3,0\n");
  const Dataset numbers = load_csv(temp("numbers.csv"));
  EXPECT_TRUE(numbers.class_names.empty());
  EXPECT_EQ(numbers.labels, (std::vector<int>{2, 0}));
  EXPECT_EQ(numbers.classes, 3);

  // Numbered by another list of names (a resumed model's), a subset keeps their numbers;
  // a name not in the list is refused naming its first sample, numbers are refused.
  Dataset some = load_csv(temp("iris.csv"));
  const std::vector<std::string> model{"virginica", "setosa", "Iris \"x\", y", "versicolor", "z"};
  renumber_classes(some, model);
  EXPECT_EQ(some.labels, (std::vector<int>{1, 0, 3, 1, 2}));
  EXPECT_EQ(some.class_names, model);
  EXPECT_EQ(some.classes, 5);
  some = load_csv(temp("iris.csv"));
  EXPECT_CONTAINS(sluice::testing::thrown_message<FormatError>([&] {
                    renumber_classes(some, {"setosa", "virginica", "versicolor"});
                  }),
                  "sample 4: class 'Iris \"x\", y' is not one of the 3 classes named");
  EXPECT_EQ(some.labels, d.labels);
  Dataset by_number = load_csv(temp("numbers.csv"));
  EXPECT_CONTAINS(
      sluice::testing::thrown_message<FormatError>([&] { renumber_classes(by_number, model); }),
      "the labels are class numbers, where the classes are named ('virginica' is "
      "class 0)");

  write(temp("empty_label.csv"), "1,a\n2, \n");
  write(temp("mixed.csv"), "1,2\n3,cat\n5,10\n");
  write(temp("semicolons.csv"), "1;2;0\n3;4;1\n");
  for (const auto& [name, message] :
       {std::pair{"empty_label.csv", "empty_label.csv:2: the label is empty"},
        std::pair{"mixed.csv", "mixed.csv:2: label 'cat' is a name, but "},
        std::pair{"semicolons.csv",
                  "semicolons.csv:2: one column, '3;4;1': a sample needs "
                  "features and a label, separated by commas"}}) {
    try {
      load_csv(temp(name));
      ADD_FAILURE() << name;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

TEST_F(DatasetFiles, BadRowsNameTheLine) {
  write(temp("bad1.csv"), "1,2,0\n1,x,1\n");
  write(temp("bad2.csv"), "1,2,0\n1,2\n1,2,3,4\n");
  write(temp("bad3.csv"), "1,2,0\n1,2,-1\n");
  write(temp("bad4.csv"), "1,2,0\n1,-1e39,1\n");  // finite, but not in fp32
  for (const char* name : {"bad1.csv", "bad2.csv", "bad3.csv", "bad4.csv"}) {
    try {
      load_csv(temp(name));
      FAIL() << name;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(":2"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(load_csv(temp("does_not_exist.csv")), IoError);
  write(temp("small.csv"), "1,2,0\n");
  EXPECT_THROW(load_digits(temp("small.csv")), FormatError);  // not 64 pixels
}

TEST(Dataset, FindsTheDigitsFile) {
  EXPECT_EQ(find_digits_file(std::filesystem::path("/x/y.csv")), std::filesystem::path("/x/y.csv"));
  setenv("SLUICE_DIGITS", "/some/digits.csv.gz", 1);
  EXPECT_EQ(find_digits_file(), std::filesystem::path("/some/digits.csv.gz"));
  unsetenv("SLUICE_DIGITS");
}

TEST(Dataset, SyntheticIsSeededAndSplitIsFixed) {
  const Dataset a = make_synthetic_dataset(500, 16, 4, 3);
  const Dataset b = make_synthetic_dataset(500, 16, 4, 3);
  EXPECT_EQ(a.labels, b.labels);
  std::vector<int> counts(4, 0);
  for (int l : a.labels) ++counts[static_cast<std::size_t>(l)];
  for (int c : counts) EXPECT_GT(c, 0);  // the teacher uses every class
  auto [train, test] = split_dataset(a, 0.2, 9);
  auto [train2, test2] = split_dataset(a, 0.2, 9);
  EXPECT_EQ(test.samples(), 100);
  EXPECT_EQ(train.samples(), 400);
  EXPECT_EQ(test.labels, test2.labels);
  EXPECT_EQ(train.features(3, 7), train2.features(3, 7));
  standardize(train, test);
  for (std::int64_t f = 0; f < train.features.rows(); ++f) {
    double sum = 0, sq = 0;
    for (std::int64_t s = 0; s < train.samples(); ++s) sum += train.features(f, s);
    for (std::int64_t s = 0; s < train.samples(); ++s)
      sq += std::pow(train.features(f, s) - sum / 400, 2);
    EXPECT_NEAR(sum / 400, 0.0, 1e-5);
    EXPECT_NEAR(sq / 400, 1.0, 1e-4);
  }
  EXPECT_THROW(split_dataset(a, 1.0, 1), ArgumentError);
  EXPECT_THROW(sample_view(a, 10, 501), ArgumentError);
}

// feature_scaling and scale_features are standardize in two: the scaling of one set, kept
// (by a model), scales another alike; a constant feature is only centred.
TEST(Dataset, AFeatureScalingScalesAnotherSetAlike) {
  Dataset a = make_synthetic_dataset(50, 3, 2, 5);
  for (std::int64_t s = 0; s < a.samples(); ++s) a.features(1, s) = 4.0F;
  const FeatureScaling scaling = feature_scaling(a);
  EXPECT_EQ(scaling.mean[1], 4.0);
  EXPECT_EQ(scaling.scale[1], 1.0);
  Dataset b = make_synthetic_dataset(10, 3, 2, 6);
  const float x = b.features(2, 3);
  scale_features(b, scaling);
  EXPECT_FLOAT_EQ(b.features(2, 3), static_cast<float>((x - scaling.mean[2]) * scaling.scale[2]));
  EXPECT_THROW(scale_features(b, FeatureScaling{{0.0}, {1.0}}), ShapeError);
}

TEST(Dataset, RefusesInconsistentOrImpossibleSets) {
  Dataset bad = make_synthetic_dataset(40, 3, 2, 1);
  bad.labels.resize(1);  // 40 samples, 1 label: the split would read past the labels
  EXPECT_THROW(split_dataset(bad, 0.5, 1), ShapeError);
  EXPECT_THROW(make_synthetic_dataset(10, 3, 1 << 30, 1), ArgumentError);  // 4 x classes overflows
  EXPECT_THROW(make_synthetic_dataset(10, std::int64_t{1} << 40, 2, 1), ArgumentError);
}

}  // namespace
}  // namespace sluice
