// ref/paged_decode.h: the readable reference for kernels/paged_decode.h, used by tests as the
// oracle. Same Params, same results up to float rounding: it computes each row's softmax in one
// pass over the whole sequence in double, with no splits, so its answer is close to exact.
//
//   laminar::kernels::PagedDecodeParams p = ...;     // as for kernels::run
//   LAMINAR_RETURN_IF_ERROR(laminar::ref::paged_decode(p));
#pragma once

#include "laminar/kernels/paged_decode.h"

namespace laminar::ref {

// Host memory only. Same validation as kernels::can_implement(p, Stream::host()).
Status paged_decode(const kernels::PagedDecodeParams& p);

}  // namespace laminar::ref
