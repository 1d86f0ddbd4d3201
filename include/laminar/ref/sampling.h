// ref/sampling.h: the readable reference for kernels::SamplingParams and TokenLogprobParams, the
// test oracle. It sorts each row, works in double precision with std::exp, and draws with the same
// Philox bits as the kernels, so it picks the same token unless the draw falls within rounding
// distance (about 1e-7 of the kept mass) of a boundary between two tokens, or the top-p cut sits
// within that distance of a boundary between two distinct logits.
#pragma once

#include "laminar/kernels/sampling.h"

namespace laminar::ref {

// Host memory only; same validation as kernels::run on the host stream.
Status sample(const kernels::SamplingParams& p);
Status token_logprob(const kernels::TokenLogprobParams& p);

}  // namespace laminar::ref
