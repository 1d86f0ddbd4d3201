// The KV migration protocol's message bodies (see kv_migration_wire.h).
#include "kv_migration_wire.h"

#include <fmt/format.h>

#include <cmath>
#include <string_view>

#include "byte_codec.h"

namespace laminar::internal {
namespace {

constexpr std::string_view kOffer = "migration offer";
constexpr std::string_view kReservation = "migration reservation";
constexpr std::string_view kStage = "migration stage";
constexpr std::string_view kStageAnswer = "migration stage answer";
constexpr std::string_view kAbort = "migration abort";

template <class Bytes>
Status read_text(ByteReader& r, std::string_view field, std::size_t limit, std::string_view what, Bytes& out) {
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, field, limit, what, n));
  const std::string_view b = r.bytes(field, n);
  const auto* p = reinterpret_cast<const typename Bytes::value_type*>(b.data());
  out.assign(p, p + b.size());
  return r.status();
}

template <class Out>
void write_text(ByteWriter<Out>& w, std::string_view text) {
  write_count(w, text.size());
  w.bytes(text);
}

// A flag byte: 0 or 1.
bool read_flag(ByteReader& r, std::string_view field) {
  const std::size_t at = r.offset();
  const std::uint8_t v = r.u8(field);
  if (v > 1) r.fail(at, fmt::format("{} is {}, not 0 or 1", field, v));
  return v == 1;
}

template <class Out>
void write_refusal(ByteWriter<Out>& w, StatusCode code, std::string_view text) {
  w.u8(std::uint8_t(code));
  write_text(w, text.substr(0, kMaxMigrationTextBytes));
}

Status read_refusal(ByteReader& r, std::string_view what, StatusCode& code, std::string& text) {
  const std::size_t at = r.offset();
  const std::uint8_t c = r.u8("status code");
  if (c > std::uint8_t(StatusCode::kInternal)) r.fail(at, fmt::format("status code {}", c));
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (c == 0) return invalid_argument(fmt::format("{}: status code OK for a failure", what));
  code = StatusCode(c);
  return read_text(r, "text", kMaxMigrationTextBytes, what, text);
}

Status read_layout(ByteReader& r, KvLayoutFingerprint& l) {
  l.num_layers = r.i32("num_layers");
  l.page_size = r.i32("page_size");
  l.num_kv_heads = r.i32("num_kv_heads");
  l.head_dim = r.i32("head_dim");
  const std::size_t at = r.offset();
  const std::uint8_t dtype = r.u8("dtype");
  if (dtype > std::uint8_t(DType::kU8)) r.fail(at, fmt::format("dtype {}", dtype));
  LAMINAR_RETURN_IF_ERROR(r.status());
  l.dtype = DType(dtype);
  if (l.num_layers <= 0 || l.page_size <= 0 || l.num_kv_heads <= 0 || l.head_dim <= 0) {
    return invalid_argument(fmt::format("{}: layout of {} layers, page_size {}, {} kv heads, head_dim {}", kOffer,
                                        l.num_layers, l.page_size, l.num_kv_heads, l.head_dim));
  }
  if (l.dtype != DType::kF32 && l.dtype != DType::kF16 && l.dtype != DType::kBF16) {
    return invalid_argument(fmt::format("{}: layout dtype {} is not a float type", kOffer, dtype));
  }
  return ok_status();
}

template <class Out>
void write_state(ByteWriter<Out>& w, const SequenceState& s) {
  w.u64(s.sequence.value());
  w.u64(s.trajectory.value());
  w.u64(s.prompt_id.value());
  w.u64(s.group_id.value());
  w.u32(s.group_size);
  w.u32(s.sample_index);
  w.u64(s.version.value());
  w.f32(s.temperature);
  w.f32(s.top_p);
  w.i32(s.top_k);
  w.u64(s.seed);
  w.u64(s.rng_position);
  w.u64(s.kv_length);
  write_count(w, s.prompt_tokens.size());
  w.array(std::span(s.prompt_tokens));
  write_count(w, s.response_tokens.size());
  w.array(std::span(s.response_tokens));
  write_count(w, s.logprobs.size());
  w.array(std::span(s.logprobs));
  write_text(w, s.engine_state);
}

Status read_state(ByteReader& r, SequenceState& s) {
  s.sequence = SequenceId(r.u64("sequence id"));
  s.trajectory = TrajectoryId(r.u64("trajectory id"));
  s.prompt_id = PromptId(r.u64("prompt id"));
  s.group_id = GroupId(r.u64("group id"));
  s.group_size = r.u32("group size");
  s.sample_index = r.u32("sample index");
  s.version = Version(r.u64("version"));
  s.temperature = r.f32("temperature");
  s.top_p = r.f32("top_p");
  s.top_k = r.i32("top_k");
  s.seed = r.u64("seed");
  s.rng_position = r.u64("rng position");
  s.kv_length = r.u64("kv length");
  LAMINAR_RETURN_IF_ERROR(r.status());
  const std::string what = fmt::format("{}: sequence {}", kStage, s.sequence.value());
  if (s.group_size == 0 || s.sample_index >= s.group_size) {
    return invalid_argument(fmt::format("{}: sample index {} of a group of {}", what, s.sample_index, s.group_size));
  }
  if (!(std::isfinite(s.temperature) && s.temperature >= 0) || !(s.top_p > 0 && s.top_p <= 1) || s.top_k < 0) {
    return invalid_argument(
        fmt::format("{}: temperature {}, top_p {}, top_k {}", what, s.temperature, s.top_p, s.top_k));
  }
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "prompt token count", kMaxMigrationTokens, what, n));
  r.array("prompt tokens", n, s.prompt_tokens);
  std::uint32_t m = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "response token count", kMaxMigrationTokens - n, what, m));
  r.array("response tokens", m, s.response_tokens);
  std::uint32_t k = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "logprob count", kMaxMigrationTokens, what, k));
  if (k != m) return invalid_argument(fmt::format("{}: {} logprobs for {} response tokens", what, k, m));
  r.array("logprobs", k, s.logprobs);
  LAMINAR_RETURN_IF_ERROR(r.status());
  for (std::size_t i = 0; i < s.logprobs.size(); ++i) {
    if (!(s.logprobs[i] <= 0)) return invalid_argument(fmt::format("{}: logprob {} is {}", what, i, s.logprobs[i]));
  }
  if (s.kv_length > std::uint64_t(n) + m) {
    return invalid_argument(fmt::format("{}: kv length {} past its {} tokens", what, s.kv_length, n + m));
  }
  return read_text(r, "engine state", kMaxMigrationEngineBytes, what, s.engine_state);
}

}  // namespace

std::vector<std::byte> encode_migration_offer(const MigrationOffer& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(37 + 20 * m.sequences.size());
  w.u64(m.migration_id);
  w.u64(m.version.value());
  w.i32(m.layout.num_layers);
  w.i32(m.layout.page_size);
  w.i32(m.layout.num_kv_heads);
  w.i32(m.layout.head_dim);
  w.u8(std::uint8_t(m.layout.dtype));
  w.u8(std::uint8_t(m.pools));
  write_count(w, m.sequences.size());
  for (const OfferedSequence& s : m.sequences) {
    w.u64(s.sequence.value());
    w.u64(s.tokens);
    w.u32(s.pages_needed);
  }
  return out;
}

Result<MigrationOffer> decode_migration_offer(std::span<const std::byte> body) {
  ByteReader r(body, kOffer);
  MigrationOffer m;
  m.migration_id = r.u64("migration id");
  m.version = Version(r.u64("version"));
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (m.migration_id == 0) return invalid_argument(fmt::format("{}: migration id 0", kOffer));
  LAMINAR_RETURN_IF_ERROR(read_layout(r, m.layout));
  const std::size_t pools_at = r.offset();
  const std::uint8_t pools = r.u8("pools");
  if (pools > std::uint8_t(KvPools::kDevice)) r.fail(pools_at, fmt::format("pools {}", pools));
  LAMINAR_RETURN_IF_ERROR(r.status());
  m.pools = KvPools(pools);
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "sequence count", kMaxMigrationSequences, kOffer, n));
  m.sequences.resize(n);
  for (OfferedSequence& s : m.sequences) {
    s.sequence = SequenceId(r.u64("sequence id"));
    s.tokens = r.u64("tokens");
    s.pages_needed = r.u32("pages needed");
    LAMINAR_RETURN_IF_ERROR(r.status());
    const std::uint64_t page = std::uint64_t(m.layout.page_size);
    if (s.tokens > kMaxMigrationTokens || s.pages_needed > kMaxMigrationPages ||
        s.pages_needed < (s.tokens + page - 1) / page) {
      return invalid_argument(fmt::format("{}: sequence {} of {} tokens needs {} pages of {}", kOffer,
                                          s.sequence.value(), s.tokens, s.pages_needed, m.layout.page_size));
    }
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_migration_reservation(const MigrationReservation& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u8(m.refusal ? 0 : 1);
  if (m.refusal) {
    write_refusal(w, m.refusal->code, m.refusal->text);
    return out;
  }
  w.u64(m.lease_ns);
  write_count(w, m.sequences.size());
  for (const ReservedSequence& s : m.sequences) {
    w.u64(s.sequence.value());
    write_count(w, s.pages.size());
    w.array(std::span(s.pages));
  }
  write_count(w, m.k_pool.size());
  w.bytes(std::span(m.k_pool));
  write_count(w, m.v_pool.size());
  w.bytes(std::span(m.v_pool));
  w.u64(m.link);
  write_count(w, m.link_token.size());
  w.bytes(std::span(m.link_token));
  return out;
}

Result<MigrationReservation> decode_migration_reservation(std::span<const std::byte> body) {
  ByteReader r(body, kReservation);
  MigrationReservation m;
  const bool granted = read_flag(r, "granted");
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (!granted) {
    MigrationRefusal refusal;
    LAMINAR_RETURN_IF_ERROR(read_refusal(r, kReservation, refusal.code, refusal.text));
    m.refusal = std::move(refusal);
    LAMINAR_RETURN_IF_ERROR(r.finish());
    return m;
  }
  m.lease_ns = r.u64("lease_ns");
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "sequence count", kMaxMigrationSequences, kReservation, n));
  m.sequences.resize(n);
  for (ReservedSequence& s : m.sequences) {
    s.sequence = SequenceId(r.u64("sequence id"));
    std::uint32_t pages = 0;
    LAMINAR_RETURN_IF_ERROR(read_count(r, "page count", kMaxMigrationPages, kReservation, pages));
    r.array("page ids", pages, s.pages);
  }
  LAMINAR_RETURN_IF_ERROR(read_text(r, "K pool region", kMaxMigrationRegionBytes, kReservation, m.k_pool));
  LAMINAR_RETURN_IF_ERROR(read_text(r, "V pool region", kMaxMigrationRegionBytes, kReservation, m.v_pool));
  m.link = r.u64("link");
  LAMINAR_RETURN_IF_ERROR(read_text(r, "link token", kMigrationLinkTokenBytes, kReservation, m.link_token));
  if ((m.link == 0) != m.link_token.empty() || (m.link != 0 && m.link_token.size() != kMigrationLinkTokenBytes)) {
    return invalid_argument(fmt::format("{}: link {:#x} with a token of {} bytes (0 and none, or not 0 and {})",
                                        kReservation, m.link, m.link_token.size(), kMigrationLinkTokenBytes));
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_migration_stage(const MigrationStage& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u64(m.migration_id);
  w.u32(m.stage);
  w.u8(m.final ? 1 : 0);
  w.u64(m.batch);
  write_count(w, m.sequences.size());
  for (const StagedSequence& s : m.sequences) {
    LAMINAR_CHECK(s.state.has_value() == m.final);
    LAMINAR_CHECK(s.runs.empty() || m.batch != 0);
    w.u64(s.sequence.value());
    w.u32(s.first_page);
    write_count(w, s.checksums.size());
    w.array(std::span(s.checksums));
    if (m.batch != 0) {
      write_count(w, s.runs.size());
      w.array(std::span(s.runs));
    }
    if (s.state) write_state(w, *s.state);
  }
  return out;
}

Result<MigrationStage> decode_migration_stage(std::span<const std::byte> body) {
  ByteReader r(body, kStage);
  MigrationStage m;
  m.migration_id = r.u64("migration id");
  m.stage = r.u32("stage");
  m.final = read_flag(r, "final");
  m.batch = r.u64("batch");
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (m.migration_id == 0) return invalid_argument(fmt::format("{}: migration id 0", kStage));
  std::uint32_t n = 0;
  LAMINAR_RETURN_IF_ERROR(read_count(r, "sequence count", kMaxMigrationSequences, kStage, n));
  m.sequences.resize(n);
  for (StagedSequence& s : m.sequences) {
    s.sequence = SequenceId(r.u64("sequence id"));
    s.first_page = r.u32("first page");
    const std::string what = fmt::format("{}: sequence {}", kStage, s.sequence.value());
    std::uint32_t pages = 0;
    LAMINAR_RETURN_IF_ERROR(read_count(r, "page count", kMaxMigrationPages, what, pages));
    if (std::uint64_t(s.first_page) + pages > kMaxMigrationPages) {
      return invalid_argument(fmt::format("{}: pages {} to {} past {}", what, s.first_page,
                                          std::uint64_t(s.first_page) + pages, kMaxMigrationPages));
    }
    r.array("checksums", pages, s.checksums);
    if (m.batch != 0) {
      std::uint32_t runs = 0;
      LAMINAR_RETURN_IF_ERROR(read_count(r, "run count", pages, what, runs));
      r.array("runs", runs, s.runs);
      LAMINAR_RETURN_IF_ERROR(r.status());
      std::uint64_t covered = 0;
      for (std::uint32_t run : s.runs) {
        if (run == 0) return invalid_argument(fmt::format("{}: a run of 0 pages", what));
        covered += run;
      }
      if (covered != pages) {
        return invalid_argument(fmt::format("{}: runs of {} pages for {} pages", what, covered, pages));
      }
    }
    if (!m.final) continue;
    s.state.emplace();
    LAMINAR_RETURN_IF_ERROR(read_state(r, *s.state));
    if (s.state->sequence != s.sequence) {
      return invalid_argument(fmt::format("{}: the state of sequence {}", what, s.state->sequence.value()));
    }
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_migration_stage_answer(const MigrationStageAnswer& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u8(m.refusal ? 0 : 1);
  if (m.refusal) {
    write_refusal(w, m.refusal->code, m.refusal->text);
  } else {
    w.u32(m.stage);
  }
  return out;
}

Result<MigrationStageAnswer> decode_migration_stage_answer(std::span<const std::byte> body) {
  ByteReader r(body, kStageAnswer);
  MigrationStageAnswer m;
  const bool acked = read_flag(r, "acked");
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (acked) {
    m.stage = r.u32("stage");
  } else {
    MigrationRefusal refusal;
    LAMINAR_RETURN_IF_ERROR(read_refusal(r, kStageAnswer, refusal.code, refusal.text));
    m.refusal = std::move(refusal);
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_migration_abort(const MigrationAbort& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u64(m.migration_id);
  w.u8(std::uint8_t(m.side));
  write_refusal(w, m.code, m.reason);
  return out;
}

Result<MigrationAbort> decode_migration_abort(std::span<const std::byte> body) {
  ByteReader r(body, kAbort);
  MigrationAbort m;
  m.migration_id = r.u64("migration id");
  const std::size_t at = r.offset();
  const std::uint8_t side = r.u8("side");
  if (side > std::uint8_t(MigrationSide::kDestination)) r.fail(at, fmt::format("side {}", side));
  LAMINAR_RETURN_IF_ERROR(r.status());
  if (m.migration_id == 0) return invalid_argument(fmt::format("{}: migration id 0", kAbort));
  m.side = MigrationSide(side);
  LAMINAR_RETURN_IF_ERROR(read_refusal(r, kAbort, m.code, m.reason));
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

}  // namespace laminar::internal
