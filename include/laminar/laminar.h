// laminar.h: the umbrella header; includes every public component header and nothing else.
#pragma once

#include "laminar/clock.h"
#include "laminar/kernels/cast.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/status.h"
#include "laminar/trajectory_queue.h"
#include "laminar/transport.h"
#include "laminar/types.h"
#include "laminar/weight_manifest.h"
