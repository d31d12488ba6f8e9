#pragma once
// What a model was trained on (ModelMemory::training_data), and what a resumed run trains
// on when not told: the same data, so that `train --resume F` goes on as if it had not
// stopped rather than on the default data set or text.
#include <ostream>
#include <string>

#include "sluice/model_memory.hpp"

namespace sluice::cli {

/// The name a model keeps of `data`: a built-in data set's name as it is, a file's or
/// directory's path made absolute (so that a run resumed from elsewhere finds it).
std::string training_data_name(const std::string& data, bool built_in);

/// What a run resuming `memory` (from `source`: "checkpoint PATH" or "model store DIR")
/// trains on when `flag` (--dataset, --text) is not given: the data it was trained on, said
/// on `progress`; "" where the model does not say. IoError where that was a file or
/// directory no longer there (`built_in` names what is not a path).
std::string resumed_training_data(const ModelMemory& memory, const std::string& source,
                                  const std::string& flag, bool (*built_in)(const std::string&),
                                  std::ostream& progress);

/// Says on `progress` that a resumed run trains `memory` on `data`, other than what it was
/// trained on (a deliberate choice, and a slip of the flags alike).
void note_other_training_data(const ModelMemory& memory, const std::string& data,
                              std::ostream& progress);

}  // namespace sluice::cli
