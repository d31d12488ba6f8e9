#pragma once
// Internal: the "DYNS" section that keeps ModelMemory::dynamic (the mask-update schedule)
// in checkpoints (version 4 on) and in a model store's manifest (version 3 on), so a
// resumed run updates its masks on the schedule it started with.
//
//   "DYNS" payload: u32 rule (0 none, 1 set, 2 rigl), i64 update_every, f64 drop,
//                   f64 update_until, i64 total_steps, u64 seed
#include <cstdint>

#include "model_memory/checkpoint_io.hpp"
#include "sluice/dynamic_sparsity.hpp"

namespace sluice::detail {

constexpr std::uint32_t kScheduleTag = fourcc("DYNS");

/// The section holding `schedule`.
Section schedule_section(const DynamicSparsity& schedule);
/// Reads the next section as a schedule; FormatError naming the file and the byte for a
/// wrong length or CRC, an unknown rule or a field out of range (update_every above 2^40,
/// total_steps above 2^53, or what DynamicSparsity::validate refuses).
DynamicSparsity read_schedule_section(FileReader& in);

}  // namespace sluice::detail
