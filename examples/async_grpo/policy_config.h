// policy_config.h: the one model both sides of the asynchronous GRPO run share: its shape and the
// names, shapes and order of its weights. The actor trains it in libtorch (trainer.h), rollout
// workers decode it over laminar's paged KV cache (engine.h), and the weights travel between them
// as one WeightManifest version through the relay tier, so both sides read this file and nothing else.
//
// A decoder-only transformer, pre-norm, no biases, f32 weights, row-major [out, in] like
// torch::nn::Linear (y = x W^T):
//   x = embed[token] + pos_embed[position]
//   per layer l:
//     h = rms_norm(x, layers.l.attn_norm)
//     q = h wq^T, k = h wk^T, v = h wv^T        (num_qo_heads / num_kv_heads query heads share a KV head)
//     x += causal_attention(q, k, v; scale 1/sqrt(head_dim)) wo^T
//     h = rms_norm(x, layers.l.mlp_norm)
//     x += (silu(h w_gate^T) * (h w_up^T)) w_down^T
//   logits = rms_norm(x, final_norm) lm_head^T
// rms_norm(x, g) = x / sqrt(mean(x^2) + rms_eps) * g.
#pragma once

#include <cstdint>
#include <string>

#include "laminar/status.h"
#include "laminar/weight_manifest.h"

namespace async_grpo {

struct PolicyConfig {
  std::int32_t vocab = 16;
  std::int32_t num_layers = 2;
  std::int32_t d_model = 128;
  std::int32_t num_qo_heads = 2;
  std::int32_t num_kv_heads = 1;  // num_qo_heads / num_kv_heads is 1, 2, 4 or 8 (the paged kernel's groups)
  std::int32_t head_dim = 64;     // 64 or 128 (the paged kernel's)
  std::int32_t d_ff = 256;
  std::int32_t max_positions = 128;  // prompt plus response tokens
  float rms_eps = 1e-5f;
};

// kInvalidArgument naming the field that is out of range.
inline laminar::Status validate(const PolicyConfig& c) {
  auto bad = [](const char* field) {
    return laminar::invalid_argument(std::string("PolicyConfig.") + field + " out of range");
  };
  if (c.vocab < 2) return bad("vocab");
  if (c.num_layers < 1) return bad("num_layers");
  if (c.head_dim != 64 && c.head_dim != 128) return bad("head_dim");
  if (c.num_kv_heads < 1 || c.num_qo_heads % c.num_kv_heads != 0) return bad("num_kv_heads");
  const std::int32_t group = c.num_qo_heads / c.num_kv_heads;
  if (group != 1 && group != 2 && group != 4 && group != 8) return bad("num_qo_heads");
  if (c.d_model < 1 || c.d_ff < 1 || c.max_positions < 2) return bad("d_model, d_ff or max_positions");
  if (!(c.rms_eps > 0.0f)) return bad("rms_eps");
  return laminar::ok_status();
}

// Every weight, f32, in this order:
//   embed [vocab, d_model], pos_embed [max_positions, d_model],
//   per layer l: layers.l.attn_norm [d_model], layers.l.wq [num_qo_heads * head_dim, d_model],
//     layers.l.wk [num_kv_heads * head_dim, d_model], layers.l.wv [num_kv_heads * head_dim, d_model],
//     layers.l.wo [d_model, num_qo_heads * head_dim], layers.l.mlp_norm [d_model],
//     layers.l.w_gate [d_ff, d_model], layers.l.w_up [d_ff, d_model], layers.l.w_down [d_model, d_ff],
//   final_norm [d_model], lm_head [vocab, d_model].
inline laminar::Result<laminar::WeightManifest> weight_manifest(const PolicyConfig& c) {
  LAMINAR_RETURN_IF_ERROR(validate(c));
  laminar::WeightManifest m;
  const std::int64_t d = c.d_model, q = std::int64_t(c.num_qo_heads) * c.head_dim,
                     kv = std::int64_t(c.num_kv_heads) * c.head_dim;
  const auto f32 = laminar::DType::kF32;
  LAMINAR_RETURN_IF_ERROR(m.add("embed", f32, {c.vocab, d}));
  LAMINAR_RETURN_IF_ERROR(m.add("pos_embed", f32, {c.max_positions, d}));
  for (std::int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LAMINAR_RETURN_IF_ERROR(m.add(p + "attn_norm", f32, {d}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "wq", f32, {q, d}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "wk", f32, {kv, d}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "wv", f32, {kv, d}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "wo", f32, {d, q}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "mlp_norm", f32, {d}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "w_gate", f32, {c.d_ff, d}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "w_up", f32, {c.d_ff, d}));
    LAMINAR_RETURN_IF_ERROR(m.add(p + "w_down", f32, {d, c.d_ff}));
  }
  LAMINAR_RETURN_IF_ERROR(m.add("final_norm", f32, {d}));
  LAMINAR_RETURN_IF_ERROR(m.add("lm_head", f32, {c.vocab, d}));
  return m;
}

}  // namespace async_grpo
