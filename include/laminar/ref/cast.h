// ref/cast.h: the readable reference for kernels::CastParams, used as the test oracle.
// It rounds by comparing distances in double precision instead of by bit tricks.
#pragma once

#include "laminar/kernels/cast.h"

namespace laminar::ref {

Status cast(const kernels::CastParams& p);

}  // namespace laminar::ref
