// What a model was trained on, and what a resumed run trains on (tools/training_data.hpp).
#include "training_data.hpp"

#include <filesystem>
#include <system_error>

#include "core/excerpt.hpp"
#include "sluice/error.hpp"

namespace sluice::cli {

std::string training_data_name(const std::string& data, bool built_in) {
  if (built_in) return data;
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(data, ec);
  return ec ? data : absolute.lexically_normal().string();
}

std::string resumed_training_data(const ModelMemory& memory, const std::string& source,
                                  const std::string& flag, bool (*built_in)(const std::string&),
                                  std::ostream& progress) {
  const std::string& data = memory.training_data;
  if (data.empty()) return data;
  std::error_code ec;
  if (!built_in(data) && !std::filesystem::exists(data, ec)) {
    throw IoError(source + " was trained on " + detail::excerpt(data, data.size()) +
                  ", which is not there now: pass " + flag + " to say what to train it on");
  }
  progress << "training on " << data << ", as " << source << " was (" << flag
           << " to choose other data)\n";
  return data;
}

void note_other_training_data(const ModelMemory& memory, const std::string& data,
                              std::ostream& progress) {
  if (memory.training_data.empty() || memory.training_data == data) return;
  progress << "the model was trained on " << memory.training_data << "; this run trains it on "
           << data << "\n";
}

}  // namespace sluice::cli
