// laminar.h: the umbrella header; includes every public component header and nothing else.
#pragma once

#include "laminar/clock.h"
#include "laminar/kernels/cast.h"
#include "laminar/kernels/paged_decode.h"
#include "laminar/kernels/sampling.h"
#include "laminar/kv_cache.h"
#include "laminar/local_relay.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/relay_versions.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/status.h"
#include "laminar/trajectory_queue.h"
#include "laminar/transport.h"
#include "laminar/types.h"
#include "laminar/weight_manifest.h"
#include "laminar/weight_puller.h"
