#pragma once
// Internal: the sections checkpoints and model store manifests share, so that a resumed
// run goes on with the model and the schedules it started with: "MODL", ModelMemory::model
// (what the layers make; checkpoints from version 3, manifests from version 5), "DYNS",
// ModelMemory::dynamic (the mask-update schedule; checkpoints from version 4, manifests
// from version 3), "LRDC", the optimizer's LearningRateDecay (checkpoints from version 5,
// manifests from version 4), "CLAS", ModelMemory::class_names, and "SCAL", its
// input_mean and input_scale (both from version 6), and "DATA", its training_data (from
// version 7).
//
//   "MODL" payload: the description's characters (printable ASCII, at most
//                   ModelMemory::kMaxModelDescription; empty for a stack of layers)
//   "DYNS" payload: u32 rule (0 none, 1 set, 2 rigl), i64 update_every, f64 drop,
//                   f64 update_until, i64 total_steps, u64 seed
//   "LRDC" payload: i64 warmup_steps, i64 decay_steps, f64 final_fraction
//   "CLAS" payload: ModelMemory::class_names, each name's bytes followed by a NUL byte
//                   (empty: classes are numbers; checkpoints and manifests from version 6)
//   "SCAL" payload: u64 count, f64 input_mean[count], f64 input_scale[count] (count 0: none
//                   kept; checkpoints and manifests from version 6)
//   "DATA" payload: ModelMemory::training_data's bytes (no NUL, at most
//                   ModelMemory::kMaxTrainingData; checkpoints and manifests from version 7)
#include <cstdint>
#include <string>
#include <vector>

#include "model_memory/checkpoint_io.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/optimizer.hpp"

namespace sluice::detail {

constexpr std::uint32_t kModelTag = fourcc("MODL");

/// Whether `model` can be kept in a checkpoint or manifest: printable ASCII, not too long.
bool storable_model(const std::string& model);
/// ShapeError ("`what`: the model description is ...") unless storable_model(model): a
/// writer's check before it writes anything.
void require_storable_model(const std::string& model, const std::string& what);
/// The section holding `model` (storable_model: the writer checks before writing).
Section model_section(const std::string& model);
/// Reads the next section as a model description; FormatError naming the file and the
/// byte for a wrong CRC, a length over the bound or a character that is not printable.
std::string read_model_section(FileReader& in);

constexpr std::uint32_t kScheduleTag = fourcc("DYNS");

/// The section holding `schedule`.
Section schedule_section(const DynamicSparsity& schedule);
/// Reads the next section as a schedule; FormatError naming the file and the byte for a
/// wrong length or CRC, an unknown rule or a field out of range (update_every above 2^40,
/// total_steps above 2^53, or what DynamicSparsity::validate refuses).
DynamicSparsity read_schedule_section(FileReader& in);

constexpr std::uint32_t kDecayTag = fourcc("LRDC");

/// The section holding `decay`.
Section decay_section(const LearningRateDecay& decay);
/// Reads the next section as a learning-rate decay; FormatError naming the file and the
/// byte for a wrong length or CRC or what LearningRateDecay::validate refuses.
LearningRateDecay read_decay_section(FileReader& in);

constexpr std::uint32_t kClassNamesTag = fourcc("CLAS");

/// ShapeError ("`what`: class name ...") unless a checkpoint can hold `names`: at most
/// ModelMemory::kMostClassNames, distinct, non-empty, without NUL bytes (the separator).
void require_storable_class_names(const std::vector<std::string>& names, const std::string& what);
/// The section holding `names` (storable: the writer checks before writing).
Section class_names_section(const std::vector<std::string>& names);
/// Reads the next section as class names; FormatError naming the file and the byte for a
/// wrong CRC, a payload that does not end a name, or names a writer would have refused.
std::vector<std::string> read_class_names_section(FileReader& in);

constexpr std::uint32_t kInputScalingTag = fourcc("SCAL");

/// ShapeError ("`what`: ...") unless a checkpoint can hold `mean` and `scale`: as many of
/// each (at most 2^31, a layer's most inputs), finite, the scales positive.
void require_storable_input_scaling(const std::vector<double>& mean,
                                    const std::vector<double>& scale, const std::string& what);
/// The section holding `mean` and `scale` (storable: the writer checks before writing).
Section input_scaling_section(const std::vector<double>& mean, const std::vector<double>& scale);
/// Reads the next section into `mean` and `scale`; FormatError naming the file and the
/// byte for a wrong length or CRC, or values a writer would have refused.
void read_input_scaling_section(FileReader& in, std::vector<double>& mean,
                                std::vector<double>& scale);

constexpr std::uint32_t kTrainingDataTag = fourcc("DATA");

/// ShapeError ("`what`: the training data's name ...") unless a checkpoint can hold
/// `name`: at most ModelMemory::kMaxTrainingData bytes, without NUL bytes.
void require_storable_training_data(const std::string& name, const std::string& what);
/// The section holding `name` (storable: the writer checks before writing).
Section training_data_section(const std::string& name);
/// Reads the next section as the training data's name; FormatError naming the file and the
/// byte for a wrong CRC, a length over the bound or a NUL byte.
std::string read_training_data_section(FileReader& in);

}  // namespace sluice::detail
