// TrajectoryQueueStats and RecoveryReport as JSON.
#include <nlohmann/json.hpp>

#include "laminar/trajectory_queue.h"
#include "stats_fields.h"

namespace laminar {

std::string TrajectoryQueueStats::to_json() const { return internal::stats_json(*this); }

std::string RecoveryReport::to_json() const { return internal::stats_json(*this); }

}  // namespace laminar
