#include "trainer.h"

#include <ATen/DLConvertor.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <string>

#include "blas.h"

namespace async_grpo {
namespace {

using laminar::invalid_argument;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs `body`, turning a libtorch exception into kInternal: nothing throws across the API.
template <class F>
auto guarded(const char* what, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::exception& e) {
    return laminar::Status(laminar::StatusCode::kInternal, std::string(what) + ": " + e.what());
  }
}

std::string trajectory_name(std::size_t i) { return "trajectory " + std::to_string(i); }

// The per-token objective on tensors ([T] each; logp carries the gradient).
struct ObjectiveTerms {
  torch::Tensor loss;     // scalar
  torch::Tensor ratio;    // [T] pi_theta / pi_prox, detached
  torch::Tensor clipped;  // [T] bool: the clip zeroed this token's gradient
};

// `tokens` is T of the objective: the whole minibatch's count when logp is one chunk of it.
ObjectiveTerms objective(const torch::Tensor& logp, const torch::Tensor& prox_logp,
                         const torch::Tensor& behaviour_logp, const torch::Tensor& advantage,
                         double tokens, const TrainerOptions& o) {
  const torch::Tensor weight = torch::exp(prox_logp - behaviour_logp).clamp_max(o.truncation);
  const torch::Tensor ratio = torch::exp(logp - prox_logp);
  const torch::Tensor unclipped = ratio * advantage;
  const torch::Tensor clipped = torch::clamp(ratio, 1.0 - o.clip_low, 1.0 + o.clip_high) * advantage;
  const torch::Tensor loss = -(weight * torch::min(unclipped, clipped)).sum() / tokens;
  const torch::Tensor r = ratio.detach();
  const torch::Tensor zeroed = ((advantage > 0) & (r > 1.0 + o.clip_high)) |
                               ((advantage < 0) & (r < 1.0 - o.clip_low));
  return {loss, r, zeroed};
}

}  // namespace

laminar::Result<std::vector<float>> group_advantages(std::span<const laminar::Trajectory> batch,
                                                     float advantage_eps) {
  if (!(advantage_eps >= 0.0f && std::isfinite(advantage_eps))) {
    return invalid_argument("advantage_eps " + std::to_string(advantage_eps) + " must be >= 0");
  }
  std::map<laminar::GroupId, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].rewards.empty() || !std::isfinite(batch[i].rewards.front())) {
      return invalid_argument(trajectory_name(i) + " has no finite rewards[0]");
    }
    groups[batch[i].group_id].push_back(i);
  }
  std::vector<float> advantages(batch.size(), 0.0f);
  for (const auto& [group, members] : groups) {
    double mean = 0;
    for (std::size_t i : members) mean += batch[i].rewards.front();
    mean /= double(members.size());
    double var = 0;
    for (std::size_t i : members) var += std::pow(batch[i].rewards.front() - mean, 2);
    const double std_dev = std::sqrt(var / double(members.size()));
    // Equal rewards carry no signal: zero, not (0 / eps) noise from rounding.
    if (members.size() < 2 || std_dev == 0.0) continue;
    for (std::size_t i : members) {
      advantages[i] = float((batch[i].rewards.front() - mean) / (std_dev + advantage_eps));
    }
  }
  return advantages;
}

laminar::Result<TokenObjective> grpo_token_objective(std::span<const float> logp,
                                                     std::span<const float> prox_logp,
                                                     std::span<const float> behaviour_logp,
                                                     std::span<const float> advantage,
                                                     const TrainerOptions& options) {
  const std::size_t n = logp.size();
  if (prox_logp.size() != n || behaviour_logp.size() != n || advantage.size() != n) {
    return invalid_argument("grpo_token_objective: logp has " + std::to_string(n) +
                            " tokens, prox_logp " + std::to_string(prox_logp.size()) +
                            ", behaviour_logp " + std::to_string(behaviour_logp.size()) +
                            ", advantage " + std::to_string(advantage.size()));
  }
  if (n == 0) return invalid_argument("grpo_token_objective: no tokens");
  for (auto [name, values] : {std::pair{"logp", logp}, std::pair{"prox_logp", prox_logp},
                              std::pair{"behaviour_logp", behaviour_logp},
                              std::pair{"advantage", advantage}}) {
    for (std::size_t i = 0; i < n; ++i) {
      if (!std::isfinite(values[i])) {
        return invalid_argument(std::string("grpo_token_objective: ") + name + "[" +
                                std::to_string(i) + "] is not finite");
      }
    }
  }
  return guarded("grpo_token_objective", [&]() -> laminar::Result<TokenObjective> {
    auto tensor = [n](std::span<const float> v) {
      return torch::from_blob(const_cast<float*>(v.data()), {std::int64_t(n)}, torch::kFloat32)
          .clone();
    };
    torch::Tensor lp = tensor(logp).requires_grad_(true);
    const ObjectiveTerms terms =
        objective(lp, tensor(prox_logp), tensor(behaviour_logp), tensor(advantage), double(n), options);
    terms.loss.backward();
    TokenObjective out;
    out.loss = terms.loss.item<double>();
    const torch::Tensor grad = lp.grad().contiguous();
    out.grad_logp.assign(grad.data_ptr<float>(), grad.data_ptr<float>() + n);
    const torch::Tensor clipped = terms.clipped.contiguous();
    out.clipped.assign(clipped.data_ptr<bool>(), clipped.data_ptr<bool>() + n);
    return out;
  });
}

struct Trainer::Impl {
  TrainerOptions options;
  laminar::WeightManifest manifest;
  std::vector<torch::Tensor> params;  // manifest order
  std::unique_ptr<torch::optim::Adam> adam;
  std::int64_t train_steps = 0;  // train_step calls that stepped Adam

  // Indices into params of one layer's weights.
  struct Layer {
    std::size_t attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
  };
  std::vector<Layer> layers;
  std::size_t embed = 0, pos_embed = 1, final_norm = 0, lm_head = 0;

  torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& g) const {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + options.policy.rms_eps) * g;
  }

  // Checks one (prompt, response) pair against the policy; `name` says which in the message.
  laminar::Status check_tokens(const std::string& name, std::span<const std::int32_t> prompt,
                               std::span<const std::int32_t> response) const {
    const PolicyConfig& c = options.policy;
    if (prompt.empty()) return invalid_argument(name + " has an empty prompt");
    if (prompt.size() + response.size() > std::size_t(c.max_positions)) {
      return invalid_argument(name + " has " + std::to_string(prompt.size() + response.size()) +
                              " tokens, more than max_positions " +
                              std::to_string(c.max_positions));
    }
    for (auto part : {prompt, response}) {
      for (std::int32_t t : part) {
        if (t < 0 || t >= c.vocab) {
          return invalid_argument(name + " has token " + std::to_string(t) + " outside vocab " +
                                  std::to_string(c.vocab));
        }
      }
    }
    return laminar::ok_status();
  }

  // Sequences packed into bins of one row each, so that long-tailed lengths cost little padding:
  // rows are placed longest first into the first bin with room (first-fit decreasing). A new bin
  // is the smallest power of two, at least kMinBin, that holds the row opening it: attention costs
  // a bin's square, so short rows share short bins. Bins of one size form chunks of at most
  // kChunkTokens tokens (or one bin).
  static constexpr std::int64_t kMinBin = 32;
  static constexpr std::int64_t kChunkTokens = 4096;
  struct Chunk {
    std::vector<std::size_t> rows;  // indices into the caller's rows, in their order in the chunk
    std::vector<std::int64_t> bin, start;  // per row of `rows`: its bin and first position there
    torch::Tensor tokens;     // [bins, L] int64
    torch::Tensor positions;  // [bins, L] int64: each token's position in its own row
    torch::Tensor masked;     // [bins, L, L] bool: true where a token may not attend
    torch::Tensor target;     // [bins, L - 1] bool: position p predicts a response token at p + 1
  };
  // A chunk's bins -> logits [bins, L, vocab]. A token attends to the tokens of its own sequence
  // up to itself (the chunk's mask), at its position within that sequence.
  torch::Tensor forward(const Chunk& chunk) const;
  static std::vector<Chunk> pack(std::span<const std::span<const std::int32_t>> prompts,
                                 std::span<const std::span<const std::int32_t>> responses) {
    auto length = [&](std::size_t i) { return std::int64_t(prompts[i].size() + responses[i].size()); };
    std::vector<std::size_t> order(prompts.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return length(a) > length(b); });
    std::vector<std::vector<std::size_t>> bins;
    std::vector<std::int64_t> fill, size;
    for (std::size_t i : order) {
      std::size_t b = 0;
      while (b < bins.size() && fill[b] + length(i) > size[b]) ++b;
      if (b == bins.size()) {
        std::int64_t cap = kMinBin;
        while (cap < length(i)) cap *= 2;
        bins.emplace_back();
        fill.push_back(0);
        size.push_back(cap);
      }
      bins[b].push_back(i);
      fill[b] += length(i);
    }
    // Bins are made largest first, so bins of one size are neighbours.
    std::vector<std::vector<std::size_t>> groups;
    for (std::size_t b = 0; b < bins.size(); ++b) {
      if (b == 0 || size[b] != size[b - 1] ||
          std::int64_t(groups.back().size() + 1) * size[b] > kChunkTokens) {
        groups.emplace_back();
      }
      groups.back().push_back(b);
    }
    std::vector<Chunk> chunks;
    for (const std::vector<std::size_t>& group : groups) {
      const auto n = std::int64_t(group.size());
      std::int64_t len = 2;
      for (std::size_t b : group) len = std::max(len, fill[b]);
      Chunk c;
      c.tokens = torch::zeros({n, len}, torch::kInt64);
      c.positions = torch::zeros({n, len}, torch::kInt64);
      c.masked = torch::ones({n, len, len}, torch::kBool);
      c.target = torch::zeros({n, len - 1}, torch::kBool);
      auto tok = c.tokens.accessor<std::int64_t, 2>();
      auto pos = c.positions.accessor<std::int64_t, 2>();
      auto mask = c.masked.accessor<bool, 3>();
      auto tgt = c.target.accessor<bool, 2>();
      for (std::int64_t b = 0; b < n; ++b) {
        std::int64_t at = 0;
        for (std::size_t row : bins[group[std::size_t(b)]]) {
          const auto& p = prompts[row];
          const auto& r = responses[row];
          const auto np = std::int64_t(p.size()), nr = std::int64_t(r.size());
          c.rows.push_back(row);
          c.bin.push_back(b);
          c.start.push_back(at);
          for (std::int64_t j = 0; j < np + nr; ++j) {
            tok[b][at + j] = j < np ? p[std::size_t(j)] : r[std::size_t(j - np)];
            pos[b][at + j] = j;
            for (std::int64_t k = 0; k <= j; ++k) mask[b][at + j][at + k] = false;
            if (j >= np) tgt[b][at + j - 1] = true;
          }
          at += np + nr;
        }
        // Padding attends to itself only: a row with nothing to attend to would be NaN.
        for (std::int64_t j = at; j < len; ++j) mask[b][j][j] = false;
      }
      chunks.push_back(std::move(c));
    }
    return chunks;
  }

  // Log-probs of a chunk's response tokens, row after row ([T]), with the graph when grad mode is on.
  torch::Tensor response_logp(const Chunk& c) const {
    const torch::Tensor logits = forward(c);
    const std::int64_t len = c.tokens.size(1);
    const torch::Tensor logp = torch::log_softmax(logits.narrow(1, 0, len - 1), -1)
                                   .gather(-1, c.tokens.narrow(1, 1, len - 1).unsqueeze(-1))
                                   .squeeze(-1);
    return logp.masked_select(c.target);
  }

  void set_learning_rate(float lr) {
    for (auto& group : adam->param_groups()) {
      static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
    }
  }

  // Clips the gradient, steps Adam; the norm before clipping.
  double step() {
    const double norm = torch::nn::utils::clip_grad_norm_(params, options.max_grad_norm);
    adam->step();
    return norm;
  }
};

torch::Tensor Trainer::Impl::forward(const Chunk& chunk) const {
  const PolicyConfig& c = options.policy;
  const torch::Tensor& tokens = chunk.tokens;
  const std::int64_t b = tokens.size(0), len = tokens.size(1);
  const std::int64_t group = c.num_qo_heads / c.num_kv_heads;
  torch::Tensor x = params[embed].index_select(0, tokens.reshape({-1})).reshape({b, len, -1}) +
                    params[pos_embed].index_select(0, chunk.positions.reshape({-1})).reshape({b, len, -1});
  const torch::Tensor masked = chunk.masked.unsqueeze(1).unsqueeze(1);  // [bins, 1, 1, L, L]: every head
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  const std::int64_t kv = c.num_kv_heads;
  for (const Layer& l : layers) {
    torch::Tensor h = rms_norm(x, params[l.attn_norm]);
    // [B, KV heads, rows, head_dim]: query head q reads KV head q / group, as the paged kernels do,
    // so a KV head's `group` query heads are one [group * L, head_dim] matrix against its keys.
    auto heads = [&](const torch::Tensor& w, std::int64_t n) {
      return torch::matmul(h, w.t()).reshape({b, len, n, c.head_dim}).permute({0, 2, 1, 3});
    };
    const torch::Tensor q = heads(params[l.wq], c.num_qo_heads).reshape({b, kv, group * len, c.head_dim});
    const torch::Tensor k = heads(params[l.wk], kv);
    const torch::Tensor v = heads(params[l.wv], kv);
    const torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1))
                                     .mul(scale)
                                     .reshape({b, kv, group, len, len})
                                     .masked_fill(masked, -INFINITY);
    const torch::Tensor att = torch::matmul(torch::softmax(scores, -1).reshape({b, kv, group * len, len}), v)
                                  .reshape({b, c.num_qo_heads, len, c.head_dim})
                                  .transpose(1, 2)
                                  .reshape({b, len, c.num_qo_heads * c.head_dim});
    x = x + torch::matmul(att, params[l.wo].t());
    h = rms_norm(x, params[l.mlp_norm]);
    const torch::Tensor gated =
        torch::silu(torch::matmul(h, params[l.w_gate].t())) * torch::matmul(h, params[l.w_up].t());
    x = x + torch::matmul(gated, params[l.w_down].t());
  }
  return torch::matmul(rms_norm(x, params[final_norm]), params[lm_head].t());
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

const TrainerOptions& Trainer::options() const noexcept { return impl_->options; }
const laminar::WeightManifest& Trainer::manifest() const noexcept { return impl_->manifest; }

laminar::Result<std::unique_ptr<Trainer>> Trainer::create(const TrainerOptions& o) {
  auto manifest = weight_manifest(o.policy);
  if (!manifest.ok()) return manifest.status();
  auto bad = [](const char* field, double value) {
    return invalid_argument(std::string("TrainerOptions.") + field + " " + std::to_string(value) +
                            " out of range");
  };
  if (o.intra_op_threads < 1) return bad("intra_op_threads", o.intra_op_threads);
  if (!(o.learning_rate > 0 && std::isfinite(o.learning_rate))) return bad("learning_rate", o.learning_rate);
  if (!(o.warmup_learning_rate > 0 && std::isfinite(o.warmup_learning_rate))) {
    return bad("warmup_learning_rate", o.warmup_learning_rate);
  }
  if (!(o.adam_beta1 >= 0 && o.adam_beta1 < 1)) return bad("adam_beta1", o.adam_beta1);
  if (!(o.adam_beta2 >= 0 && o.adam_beta2 < 1)) return bad("adam_beta2", o.adam_beta2);
  if (!(o.adam_eps > 0 && std::isfinite(o.adam_eps))) return bad("adam_eps", o.adam_eps);
  if (!(o.max_grad_norm > 0 && std::isfinite(o.max_grad_norm))) return bad("max_grad_norm", o.max_grad_norm);
  if (!(o.clip_low > 0 && o.clip_low < 1)) return bad("clip_low", o.clip_low);
  if (!(o.clip_high > 0 && std::isfinite(o.clip_high))) return bad("clip_high", o.clip_high);
  if (!(o.truncation > 0 && std::isfinite(o.truncation))) return bad("truncation", o.truncation);
  if (!(o.advantage_eps >= 0 && std::isfinite(o.advantage_eps))) return bad("advantage_eps", o.advantage_eps);
  if (o.minibatches < 1) return bad("minibatches", o.minibatches);
  if (o.learning_rate_warmup_steps < 0) return bad("learning_rate_warmup_steps", o.learning_rate_warmup_steps);

  return guarded("Trainer::create", [&]() -> laminar::Result<std::unique_ptr<Trainer>> {
    torch::set_num_threads(o.intra_op_threads);
    set_blas_threads(o.intra_op_threads);
    auto impl = std::make_unique<Impl>();
    impl->options = o;
    impl->manifest = std::move(*manifest);
    // GPT-2's init: N(0, 0.02), the projections into the residual stream scaled by
    // 1/sqrt(2 * layers) so the residual's variance does not grow with depth; norms start at 1.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
    const double residual_std = 0.02 / std::sqrt(2.0 * o.policy.num_layers);
    for (const auto& e : impl->manifest.entries()) {
      const std::string& name = e.name;
      torch::Tensor t;
      if (name.ends_with("norm")) {
        t = torch::ones(e.shape, torch::kFloat32);
      } else {
        const bool residual = name.ends_with(".wo") || name.ends_with(".w_down");
        t = torch::randn(e.shape, generator, torch::kFloat32) * (residual ? residual_std : 0.02);
      }
      impl->params.push_back(t.requires_grad_(true));
    }
    std::size_t i = 2;  // after embed and pos_embed, in manifest order
    for (std::int32_t l = 0; l < o.policy.num_layers; ++l, i += 9) {
      impl->layers.push_back({i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7, i + 8});
    }
    impl->final_norm = i;
    impl->lm_head = i + 1;
    impl->adam = std::make_unique<torch::optim::Adam>(
        impl->params, torch::optim::AdamOptions(o.learning_rate)
                          .betas({o.adam_beta1, o.adam_beta2})
                          .eps(o.adam_eps));
    return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
  });
}

laminar::Result<std::vector<laminar::NamedTensor>> Trainer::weights() const {
  std::vector<laminar::NamedTensor> out;
  const auto entries = impl_->manifest.entries();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    DLManagedTensor* managed = at::toDLPack(impl_->params[i].detach());
    auto view = laminar::TensorView::from_dlpack(managed->dl_tensor);
    managed->deleter(managed);  // the view copied shape and strides; the parameter owns the data
    if (!view.ok()) return view.status();
    LAMINAR_RETURN_IF_ERROR(impl_->manifest.check_view(entries[i].name, *view));
    out.push_back({entries[i].name, *view});
  }
  return out;
}

laminar::Status Trainer::load_weights(std::span<const std::byte> flat) {
  if (flat.size() != impl_->manifest.total_bytes()) {
    return invalid_argument("load_weights: buffer of " + std::to_string(flat.size()) +
                            " bytes, the manifest lays out " +
                            std::to_string(impl_->manifest.total_bytes()));
  }
  const auto entries = impl_->manifest.entries();
  for (const auto& e : entries) {
    const auto* values = reinterpret_cast<const float*>(flat.data() + e.offset);
    for (std::uint64_t j = 0; j < e.nbytes / sizeof(float); ++j) {
      if (!std::isfinite(values[j])) {
        return invalid_argument("load_weights: " + e.name + "[" + std::to_string(j) +
                                "] is not finite");
      }
    }
  }
  return guarded("Trainer::load_weights", [&]() -> laminar::Status {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      std::memcpy(impl_->params[i].data_ptr<float>(), flat.data() + entries[i].offset,
                  entries[i].nbytes);
    }
    return laminar::ok_status();
  });
}

laminar::Status Trainer::save_weights(std::span<std::byte> flat) const {
  if (flat.size() != impl_->manifest.total_bytes()) {
    return invalid_argument("save_weights: buffer of " + std::to_string(flat.size()) +
                            " bytes, the manifest lays out " +
                            std::to_string(impl_->manifest.total_bytes()));
  }
  std::memset(flat.data(), 0, flat.size());
  const auto entries = impl_->manifest.entries();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::memcpy(flat.data() + entries[i].offset, impl_->params[i].data_ptr<float>(),
                entries[i].nbytes);
  }
  return laminar::ok_status();
}

laminar::Status Trainer::save_checkpoint(const std::filesystem::path& path, std::uint64_t version,
                                         std::span<const std::byte> host_state) const {
  const std::filesystem::path tmp = path.string() + ".tmp";
  auto saved = guarded("Trainer::save_checkpoint", [&]() -> laminar::Status {
    torch::NoGradGuard no_grad;
    torch::serialize::OutputArchive archive;
    const auto entries = impl_->manifest.entries();
    for (std::size_t i = 0; i < entries.size(); ++i) archive.write("weights." + entries[i].name, impl_->params[i]);
    archive.write("train_steps", torch::tensor(impl_->train_steps, torch::kInt64));
    archive.write("version", torch::tensor(std::int64_t(version), torch::kInt64));
    torch::Tensor host = torch::empty({std::int64_t(host_state.size())}, torch::kUInt8);
    if (!host_state.empty()) std::memcpy(host.data_ptr<std::uint8_t>(), host_state.data(), host_state.size());
    archive.write("host_state", host);
    torch::serialize::OutputArchive adam;
    impl_->adam->save(adam);
    archive.write("adam", adam);
    archive.save_to(tmp.string());
    return laminar::ok_status();
  });
  if (!saved.ok()) return laminar::unavailable("cannot write checkpoint " + tmp.string() + ": " + saved.message());
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return laminar::unavailable("cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message());
  return laminar::ok_status();
}

laminar::Result<Trainer::Checkpoint> Trainer::load_checkpoint(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return laminar::not_found("no checkpoint at " + path.string());
  // Everything is read and checked before anything changes: the weights into new tensors, Adam's
  // state into a new optimizer over the same parameters.
  auto loaded = guarded("Trainer::load_checkpoint", [&]() -> laminar::Result<Checkpoint> {
    torch::NoGradGuard no_grad;
    torch::serialize::InputArchive archive;
    archive.load_from(path.string());
    const auto entries = impl_->manifest.entries();
    std::vector<torch::Tensor> weights(entries.size());
    for (std::size_t i = 0; i < entries.size(); ++i) {
      archive.read("weights." + entries[i].name, weights[i]);
      if (!weights[i].sizes().equals(impl_->params[i].sizes()) || weights[i].scalar_type() != torch::kFloat32) {
        return laminar::data_loss(path.string() + ": " + entries[i].name + " has another shape than the policy's");
      }
    }
    torch::Tensor steps, version, host;
    archive.read("train_steps", steps);
    archive.read("version", version);
    archive.read("host_state", host);
    if (host.dim() != 1 || host.scalar_type() != torch::kUInt8) {
      return laminar::data_loss(path.string() + ": its host state is not a byte string");
    }
    host = host.contiguous();
    Checkpoint out{std::uint64_t(version.item<std::int64_t>()), std::vector<std::byte>(std::size_t(host.numel()))};
    if (!out.host_state.empty()) std::memcpy(out.host_state.data(), host.data_ptr<std::uint8_t>(), out.host_state.size());
    torch::serialize::InputArchive adam_archive;
    archive.read("adam", adam_archive);
    auto adam = std::make_unique<torch::optim::Adam>(
        impl_->params, static_cast<const torch::optim::AdamOptions&>(impl_->adam->defaults()));
    adam->load(adam_archive);
    for (std::size_t i = 0; i < entries.size(); ++i) impl_->params[i].copy_(weights[i]);
    impl_->adam = std::move(adam);
    impl_->train_steps = steps.item<std::int64_t>();
    return out;
  });
  if (!loaded.ok() && loaded.status().code() == laminar::StatusCode::kInternal) {
    return laminar::data_loss(path.string() + " is not a whole checkpoint of this policy: " + loaded.status().message());
  }
  return loaded;
}

laminar::Result<std::vector<std::vector<float>>> Trainer::log_probs(
    std::span<const laminar::Trajectory> batch) const {
  std::vector<std::span<const std::int32_t>> prompts, responses;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    LAMINAR_RETURN_IF_ERROR(
        impl_->check_tokens(trajectory_name(i), batch[i].prompt_tokens, batch[i].response_tokens));
    prompts.emplace_back(batch[i].prompt_tokens);
    responses.emplace_back(batch[i].response_tokens);
  }
  if (batch.empty()) return std::vector<std::vector<float>>{};
  return guarded("Trainer::log_probs", [&]() -> laminar::Result<std::vector<std::vector<float>>> {
    torch::NoGradGuard no_grad;
    std::vector<std::vector<float>> out(batch.size());
    for (const Impl::Chunk& c : Impl::pack(prompts, responses)) {
      const torch::Tensor logp = impl_->response_logp(c).contiguous();
      const float* p = logp.data_ptr<float>();
      for (std::size_t i : c.rows) {
        out[i].assign(p, p + responses[i].size());
        p += responses[i].size();
      }
    }
    return out;
  });
}

laminar::Result<TrainStats> Trainer::train_step(std::span<const laminar::Trajectory> batch) {
  const auto start = std::chrono::steady_clock::now();
  if (batch.empty()) return invalid_argument("train_step: empty batch");
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const laminar::Trajectory& t = batch[i];
    LAMINAR_RETURN_IF_ERROR(impl_->check_tokens(trajectory_name(i), t.prompt_tokens, t.response_tokens));
    if (t.response_tokens.empty()) return invalid_argument(trajectory_name(i) + " has no response");
    if (t.logprobs.size() != t.response_tokens.size()) {
      return invalid_argument(trajectory_name(i) + " has " + std::to_string(t.logprobs.size()) +
                              " logprobs for " + std::to_string(t.response_tokens.size()) +
                              " response tokens");
    }
    for (float lp : t.logprobs) {
      if (!std::isfinite(lp)) return invalid_argument(trajectory_name(i) + " has a non-finite logprob");
    }
  }
  auto advantages = group_advantages(batch, impl_->options.advantage_eps);
  if (!advantages.ok()) return advantages.status();

  return guarded("Trainer::train_step", [&]() -> laminar::Result<TrainStats> {
    const TrainerOptions& o = impl_->options;
    const std::int64_t ramp = o.learning_rate_warmup_steps;
    const double scale = ramp > 0 ? std::min(1.0, double(impl_->train_steps + 1) / double(ramp)) : 1.0;
    impl_->set_learning_rate(float(o.learning_rate * scale));
    ++impl_->train_steps;
    const auto minibatches = std::min<std::size_t>(std::size_t(o.minibatches), batch.size());
    TrainStats stats;
    stats.trajectories = std::int64_t(batch.size());
    for (const auto& t : batch) stats.mean_reward += t.rewards.front();
    stats.mean_reward /= double(batch.size());

    // Each chunk of each minibatch: its rows, pi_prox (before any update), mu and A per token.
    struct Part {
      Impl::Chunk chunk;
      torch::Tensor prox, behaviour, advantage;  // [T of the chunk]
    };
    struct Minibatch {
      std::vector<Part> parts;
      std::int64_t tokens = 0;
    };
    std::vector<Minibatch> minibatch_parts(minibatches);
    {
      torch::NoGradGuard no_grad;
      for (std::size_t m = 0; m < minibatches; ++m) {
        const std::size_t begin = batch.size() * m / minibatches;
        const std::size_t end = batch.size() * (m + 1) / minibatches;
        std::vector<std::span<const std::int32_t>> prompts, responses;
        for (std::size_t i = begin; i < end; ++i) {
          prompts.emplace_back(batch[i].prompt_tokens);
          responses.emplace_back(batch[i].response_tokens);
        }
        for (Impl::Chunk& c : Impl::pack(prompts, responses)) {
          std::vector<float> behaviour, advantage;
          for (std::size_t row : c.rows) {
            const laminar::Trajectory& t = batch[begin + row];
            behaviour.insert(behaviour.end(), t.logprobs.begin(), t.logprobs.end());
            advantage.insert(advantage.end(), t.response_tokens.size(), (*advantages)[begin + row]);
          }
          Part part;
          part.prox = impl_->response_logp(c);
          part.behaviour = torch::tensor(behaviour, torch::kFloat32);
          part.advantage = torch::tensor(advantage, torch::kFloat32);
          part.chunk = std::move(c);
          minibatch_parts[m].tokens += part.prox.size(0);
          minibatch_parts[m].parts.push_back(std::move(part));
        }
      }
    }
    double clipped = 0, ratio_sum = 0, truncated = 0, kl_sum = 0;
    for (Minibatch& mb : minibatch_parts) {
      impl_->adam->zero_grad();
      for (Part& part : mb.parts) {
        const torch::Tensor logp = impl_->response_logp(part.chunk);
        const ObjectiveTerms terms = objective(logp, part.prox, part.behaviour, part.advantage,
                                               double(mb.tokens), o);
        terms.loss.backward();
        stats.loss += terms.loss.item<double>();
        clipped += terms.clipped.sum().item<double>();
        ratio_sum += torch::exp(logp.detach() - part.behaviour).sum().item<double>();
        const torch::Tensor q = torch::exp(part.prox - part.behaviour);
        truncated += (q > o.truncation).sum().item<double>();
        kl_sum += (q - 1 - torch::log(q)).sum().item<double>();
      }
      stats.grad_norm += impl_->step();
      stats.tokens += mb.tokens;
    }
    stats.loss /= double(minibatch_parts.size());
    stats.grad_norm /= double(minibatch_parts.size());
    const auto tokens = double(stats.tokens);
    stats.clip_fraction = clipped / tokens;
    stats.mean_ratio = ratio_sum / tokens;
    stats.truncated_fraction = truncated / tokens;
    stats.kl = kl_sum / tokens;
    stats.seconds = seconds_since(start);
    return stats;
  });
}

laminar::Result<WarmupStats> Trainer::warmup_step(std::span<const DigitPrompt> prompts) {
  const auto start = std::chrono::steady_clock::now();
  if (prompts.empty()) return invalid_argument("warmup_step: no prompts");
  std::vector<std::span<const std::int32_t>> tokens, answers;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    LAMINAR_RETURN_IF_ERROR(impl_->check_tokens("prompt " + std::to_string(prompts[i].index),
                                                prompts[i].tokens, prompts[i].answer));
    if (prompts[i].answer.empty()) {
      return invalid_argument("prompt " + std::to_string(prompts[i].index) + " has no answer");
    }
    tokens.emplace_back(prompts[i].tokens);
    answers.emplace_back(prompts[i].answer);
  }
  return guarded("Trainer::warmup_step", [&]() -> laminar::Result<WarmupStats> {
    impl_->set_learning_rate(impl_->options.warmup_learning_rate);
    std::int64_t total = 0;
    for (const auto& a : answers) total += std::int64_t(a.size());
    impl_->adam->zero_grad();
    WarmupStats stats;
    double right = 0;
    for (const Impl::Chunk& c : Impl::pack(tokens, answers)) {
      const torch::Tensor logits = impl_->forward(c);
      const std::int64_t len = c.tokens.size(1), vocab = logits.size(-1);
      const torch::Tensor predicted =
          logits.narrow(1, 0, len - 1).masked_select(c.target.unsqueeze(-1)).reshape({-1, vocab});
      const torch::Tensor wanted = c.tokens.narrow(1, 1, len - 1).masked_select(c.target);
      const torch::Tensor loss =
          torch::nn::functional::cross_entropy(
              predicted, wanted, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
          double(total);
      loss.backward();
      stats.loss += loss.item<double>();
      right += predicted.detach().argmax(-1).eq(wanted).sum().item<double>();
    }
    impl_->step();
    stats.accuracy = right / double(total);
    stats.seconds = seconds_since(start);
    return stats;
  });
}

laminar::Result<std::vector<laminar::Trajectory>> Trainer::generate(
    const DigitTask& task, std::span<const DigitPrompt> prompts, std::int32_t group_size,
    float temperature, std::uint64_t seed, laminar::Version version) const {
  if (group_size < 1) return invalid_argument("generate: group_size " + std::to_string(group_size) + " < 1");
  if (!(temperature > 0 && std::isfinite(temperature))) {
    return invalid_argument("generate: temperature " + std::to_string(temperature) + " must be > 0");
  }
  for (const DigitPrompt& p : prompts) {
    const std::string name = "prompt " + std::to_string(p.index);
    LAMINAR_RETURN_IF_ERROR(impl_->check_tokens(name, p.tokens, {}));
    if (p.tokens.size() + std::size_t(task.max_response_tokens(p)) >
        std::size_t(impl_->options.policy.max_positions)) {
      return invalid_argument(name + " and its response budget exceed max_positions");
    }
  }
  return guarded("Trainer::generate", [&]() -> laminar::Result<std::vector<laminar::Trajectory>> {
    torch::NoGradGuard no_grad;
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<laminar::Trajectory> out;
    std::vector<std::int32_t> budget;
    for (const DigitPrompt& p : prompts) {
      for (std::int32_t s = 0; s < group_size; ++s) {
        laminar::Trajectory t;
        t.id = laminar::TrajectoryId(p.index * std::uint64_t(group_size) + std::uint64_t(s));
        t.prompt_id = laminar::PromptId(p.index);
        t.group_id = laminar::GroupId(p.index);
        t.group_size = std::uint32_t(group_size);
        t.sample_index = std::uint32_t(s);
        t.version = version;
        t.prompt_tokens = p.tokens;
        out.push_back(std::move(t));
        budget.push_back(task.max_response_tokens(p));
      }
    }
    // Without a KV cache: every step re-runs the live rows over their whole prefix, which is cheap
    // at this model's size and keeps one forward() for training and sampling.
    std::vector<std::size_t> live(out.size());
    for (std::size_t i = 0; i < live.size(); ++i) live[i] = i;
    std::erase_if(live, [&](std::size_t i) { return budget[i] == 0; });
    while (!live.empty()) {
      std::vector<std::vector<std::int32_t>> joined;
      for (std::size_t i : live) {
        joined.push_back(out[i].prompt_tokens);
        joined.back().insert(joined.back().end(), out[i].response_tokens.begin(),
                             out[i].response_tokens.end());
      }
      const std::vector<std::span<const std::int32_t>> rows(joined.begin(), joined.end());
      const std::vector<std::span<const std::int32_t>> none(live.size());
      for (const Impl::Chunk& c : Impl::pack(rows, none)) {
        const torch::Tensor logits = impl_->forward(c);
        std::vector<std::int64_t> last;
        for (std::size_t k = 0; k < c.rows.size(); ++k) {
          last.push_back(c.start[k] + std::int64_t(rows[c.rows[k]].size()) - 1);
        }
        const torch::Tensor next_logits = logits.index({torch::tensor(c.bin), torch::tensor(last)}) / temperature;
        const torch::Tensor logp = torch::log_softmax(next_logits, -1);
        const torch::Tensor picked =
            torch::multinomial(logp.exp(), 1, false, generator).squeeze(-1).contiguous();
        const torch::Tensor picked_logp =
            logp.gather(-1, picked.unsqueeze(-1)).squeeze(-1).contiguous();
        for (std::size_t k = 0; k < c.rows.size(); ++k) {
          laminar::Trajectory& t = out[live[c.rows[k]]];
          t.response_tokens.push_back(std::int32_t(picked.data_ptr<std::int64_t>()[k]));
          t.logprobs.push_back(picked_logp.data_ptr<float>()[k]);
        }
      }
      std::erase_if(live, [&](std::size_t i) {
        const auto& r = out[i].response_tokens;
        return r.back() == kEos || std::int32_t(r.size()) >= budget[i];
      });
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      laminar::Trajectory& t = out[i];
      const DigitPrompt& p = prompts[i / std::size_t(group_size)];
      t.finish_reason = !t.response_tokens.empty() && t.response_tokens.back() == kEos
                            ? laminar::FinishReason::kStop
                            : laminar::FinishReason::kLength;
      t.rewards = {task.reward(p, t.response_tokens)};
    }
    return out;
  });
}

}  // namespace async_grpo
