// A machine's own PathCosts in a file: what `sluice sweep --path both --save-path-costs`
// writes and SLUICE_PATH_COSTS names (sluice/path_cost.hpp).
#include <algorithm>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/input_file.hpp"
#include "sluice/error.hpp"
#include "sluice/path_cost.hpp"

namespace sluice {
namespace {

constexpr const char* kFormat = "sluice path costs";
constexpr int kVersion = 1;
constexpr std::array<const char*, 2> kPrecisions = {"fp32", "bf16"};
constexpr std::array<const char*, 5> kTerms = {"sparse_per_nnz_token", "dense_per_mac",
                                               "sparse_per_nnz", "densify_per_slot",
                                               "densify_per_packet"};

std::array<std::array<double, 2>*, 5> terms_of(PathCosts& c) {
  return {&c.sparse_per_nnz_token, &c.dense_per_mac, &c.sparse_per_nnz, &c.densify_per_slot,
          &c.densify_per_packet};
}

[[noreturn]] void refuse(const std::filesystem::path& file, const std::string& what) {
  throw FormatError("path costs " + file.string() + ": " + what);
}

/// One precision's four terms: each a finite number of seconds, not negative; the
/// streamed product's and the multiply-add's above zero (a free product would always win).
void read_precision(const std::filesystem::path& file, const nlohmann::json& j,
                    const std::string& precision, std::size_t p, PathCosts& c) {
  if (!j.is_object()) refuse(file, "\"" + precision + "\" is not an object");
  for (const auto& item : j.items()) {
    const std::string& key = item.key();  // a name, not a binding: lambdas capture it
    if (std::find_if(kTerms.begin(), kTerms.end(), [&](const char* t) { return key == t; }) ==
        kTerms.end()) {
      refuse(file, "\"" + precision + "\" has an unknown term \"" + key + "\"");
    }
  }
  const auto terms = terms_of(c);
  for (std::size_t t = 0; t < kTerms.size(); ++t) {
    const std::string where = "\"" + precision + "\".\"" + kTerms[t] + "\"";
    if (!j.contains(kTerms[t])) refuse(file, where + " is missing");
    const nlohmann::json& v = j.at(kTerms[t]);
    if (!v.is_number()) refuse(file, where + " is not a number");
    const double seconds = v.get<double>();
    const bool must_be_positive = t < 2;  // kTerms lists those two first
    if (!std::isfinite(seconds) || seconds < 0 || (must_be_positive && seconds == 0)) {
      refuse(file, where + " is " + v.dump() + ", not a" +
                       (must_be_positive ? " positive" : " non-negative") + " number of seconds");
    }
    (*terms[t])[p] = seconds;
  }
}

}  // namespace

PathCosts PathCosts::read(const std::filesystem::path& file, const PathCosts& base) {
  const nlohmann::json j = nlohmann::json::parse(detail::read_file_bytes(file), nullptr, false);
  if (j.is_discarded()) refuse(file, "not JSON");
  if (!j.is_object()) refuse(file, "not a JSON object");
  if (j.value("format", "") != kFormat)
    refuse(file, std::string("\"format\" is not \"") + kFormat + "\"");
  if (!j.contains("version") || j.at("version") != kVersion) {
    refuse(file, "\"version\" is not " + std::to_string(kVersion));
  }
  PathCosts c = base;
  bool any = false;
  for (const auto& item : j.items()) {
    const std::string& key = item.key();  // a name, not a binding: lambdas capture it
    if (key == "format" || key == "version") continue;
    const auto at = std::find_if(kPrecisions.begin(), kPrecisions.end(),
                                 [&](const char* p) { return key == p; });
    if (at == kPrecisions.end()) refuse(file, "unknown key \"" + key + "\"");
    read_precision(file, item.value(), key, static_cast<std::size_t>(at - kPrecisions.begin()), c);
    any = true;
  }
  if (!any) refuse(file, "holds neither \"fp32\" nor \"bf16\"");
  return c;
}

std::string PathCosts::to_json() const {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  PathCosts copy = *this;
  const auto terms = terms_of(copy);
  for (std::size_t p = 0; p < kPrecisions.size(); ++p) {
    nlohmann::ordered_json one;
    for (std::size_t t = 0; t < kTerms.size(); ++t) one[kTerms[t]] = (*terms[t])[p];
    j[kPrecisions[p]] = one;
  }
  return j.dump(2) + "\n";
}

}  // namespace sluice
