#pragma once
// The cost model, all of it: Amdahl's law for a streamed layer
// (sluice/layer_cost_model.hpp), its calibration to measured runs (sluice/calibration.hpp),
// the wafer-scale system's parameters (sluice/wafer_system.hpp) and the scaling laws of
// the predictions (sluice/scaling_laws.hpp).
#include "sluice/calibration.hpp"
#include "sluice/layer_cost_model.hpp"
#include "sluice/scaling_laws.hpp"
#include "sluice/wafer_system.hpp"
