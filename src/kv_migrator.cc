// KvMigrator (see kv_migrator.h): creation, the public calls, and the source side of the
// protocol. The destination side is in kv_migrator_destination.cc.
#include "laminar/kv_migrator.h"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "clock_wait.h"
#include "kv_migrator_impl.h"
#include "transport/protocol.h"
#include "stats_fields.h"

namespace laminar {

namespace {

using internal::MigrationAbort;
using internal::MigrationSide;
using internal::MigrationStage;
using internal::StagedSequence;

constexpr MessageType kOffer = internal::kMigrationOfferMessage;
constexpr MessageType kStage = internal::kMigrationStageMessage;
constexpr MessageType kAbort = internal::kMigrationAbortMessage;

// Messages waiting for poll(), at most: a host that stops polling cannot make the callback
// thread's queue grow without bound. One more request is answered kResourceExhausted.
constexpr std::size_t kInboxLimit = 256;
constexpr std::size_t kMaxFinished = 1024;
// Stages with puts or an answer outstanding: the destination checks one while the next is put.
constexpr std::size_t kStagesInFlight = 2;
constexpr Duration kShutdownBudget = std::chrono::seconds(1);
// How often wait_event() polls while device work is in flight, which wakes nothing when it ends.
constexpr Duration kDevicePollInterval = std::chrono::microseconds(100);


template <class T>
bool ready(const std::future<T>& f) {
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

std::int64_t pages_for(std::int64_t tokens, std::int32_t page_size) { return (tokens + page_size - 1) / page_size; }

// Why a failed request or put ended the migration, as the source sees it: its own give-up when
// the destination stalled, the destination's doing otherwise.
MigrationState blame(const Status& s) {
  return s.code() == StatusCode::kDeadlineExceeded ? MigrationState::kAbortedBySource
                                                   : MigrationState::kAbortedByDestination;
}

}  // namespace

std::string_view to_string(MigrationState s) noexcept {
  switch (s) {
    case MigrationState::kRunning: return "running";
    case MigrationState::kAbortedBySource: return "aborted by source";
    case MigrationState::kAbortedByDestination: return "aborted by destination";
    case MigrationState::kDone: return "done";
  }
  return "unknown";
}

std::string KvMigratorStats::to_json() const { return internal::stats_json(*this); }

KvMigrator::Impl::Impl(std::shared_ptr<Transport> t, std::shared_ptr<PagedKvCache> c, KvMigratorOptions o)
    : transport(std::move(t)),
      cache(std::move(c)),
      options(std::move(o)),
      clock(internal::clock_or_steady(options.clock)) {}

// ---- shared ----

void KvMigrator::Impl::queue(Incoming msg) {
  bool queued = false;
  {
    std::lock_guard lock(inbox->mu);
    if (inbox->messages < kInboxLimit) {
      ++inbox->messages;
      inbox->items.push_back(Inbound{std::move(msg), false, EndpointId(), {}});
      queued = true;
    }
  }
  if (queued) return inbox->wake();
  // Transient: the room comes back at the host's next poll().
  if (msg.request_id != RequestId()) {
    (void)msg.from.reply_error(msg, unavailable(fmt::format("kv migrator: {} messages wait for poll()", kInboxLimit)));
  }
}

void KvMigrator::Impl::watch(const Endpoint& ep) {
  if (watches.contains(ep.id())) return;
  const EndpointId id = ep.id();
  auto sub = ep.on_close([box = inbox, id](Status why) {
    {
      std::lock_guard lock(box->mu);
      box->items.push_back(Inbound{{}, true, id, std::move(why)});
    }
    box->wake();
  });
  // Fails only for an empty endpoint, which no migration has.
  LAMINAR_CHECK_MSG(sub.ok(), sub.status().to_string());
  watches.emplace(id, Watch{ep, std::move(*sub)});
}

void KvMigrator::Impl::record_finished(MigrationId id, MigrationState state, bool outgoing, Status reason) {
  if (!finished.contains(id.value())) {
    finished_order.push_back(id.value());
    if (finished_order.size() > kMaxFinished) {
      finished.erase(finished_order.front());
      finished_order.pop_front();
    }
  }
  finished[id.value()] = Finished{state, outgoing, std::move(reason)};
}

void KvMigrator::Impl::record_error(const Status& s) {
  if (first_error.ok()) first_error = s;
}

std::uint64_t KvMigrator::Impl::page_checksum(std::int32_t page) const {
  const KvLayout& l = cache->layout();
  const auto* k = reinterpret_cast<const unsigned char*>(k_region.data());
  const auto* v = reinterpret_cast<const unsigned char*>(v_region.data());
  const std::size_t bytes = std::size_t(l.page_bytes());
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (const unsigned char* pool : {k, v}) {
    for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
      XXH3_64bits_update(&state, pool + (std::int64_t(layer) * l.num_pages + page) * l.page_bytes(), bytes);
    }
  }
  return XXH3_64bits_digest(&state);
}

void KvMigrator::Impl::send_abort(Endpoint& ep, const MigrationAbort& m, Duration timeout) {
  if (timeout <= Duration::zero() || !ep.status().ok()) return;
  (void)internal::send_protocol(ep, Message{kAbort, internal::encode_migration_abort(m)}, timeout);
}

void KvMigrator::Impl::sweep() {
  std::erase_if(out, [](const auto& kv) { return kv.second.ended; });
  std::erase_if(in, [](const auto& kv) { return kv.second.ended; });
  std::unordered_set<EndpointId> used;
  for (const auto& [id, m] : out) used.insert(m.ep.id());
  for (const auto& [id, m] : in) used.insert(m.ep.id());
  for (const auto& [addr, ep] : connections) used.insert(ep.id());
  for (const Draining& d : draining) used.insert(d.ep.id());
  for (const auto& [id, f] : fenced) used.insert(f.ep.id());
  for (const auto& [id, l] : links) used.insert(l.ep.id());
  // Resetting a subscription waits for its callback, which takes only the inbox's lock.
  std::erase_if(watches, [&](const auto& kv) { return !used.contains(kv.first); });
}

Duration KvMigrator::Impl::next_deadline() const {
  Duration at = kForever;
  const auto after = [&](Duration from, Duration timeout) { at = std::min(at, deadline_after(from, timeout)); };
  for (const auto& [id, m] : in) {
    if (!m.ended) at = std::min(at, m.deadline);
  }
  for (const auto& [id, f] : fenced) at = std::min(at, f.until);
  for (const auto& [id, m] : out) {
    if (m.ended) continue;
    if (!m.reserved) after(m.offer_sent_at, options.stall_timeout);
    if (!m.stages.empty() && m.stages.front().sent) after(m.stages.front().sent_at, options.stall_timeout);
    // One poll() builds one live stage at most (see advance_out): the next may be built at once.
    if (m.reserved && m.phase == OutPhase::kLive && !m.todo.empty() && m.stages.size() < kStagesInFlight) {
      at = std::min(at, clock->now());
    }
  }
  for (const auto& [id, l] : links) {
    if (!l.joined) at = std::min(at, l.join_deadline);
  }
  // NCCL and CUDA events call nothing back: poll() queries them.
  if (device && (!out.empty() || !in.empty() || !links.empty())) after(clock->now(), kDevicePollInterval);
  return at;
}

void KvMigrator::Impl::on_closed(EndpointId endpoint_id, const Status& why) {
  std::erase_if(connections, [&](const auto& kv) { return kv.second.id() == endpoint_id; });
  std::vector<std::uint64_t> gone;
  for (const auto& [id, l] : links) {
    if (l.ep.id() == endpoint_id) gone.push_back(id);
  }
  for (std::uint64_t id : gone) {
    drop_link(id, unavailable(fmt::format("kv migrator: the connection of NCCL link {:#x} closed: {}", id,
                                          why.to_string())));
  }
  for (auto& [id, m] : out) {
    if (m.ended || m.ep.id() != endpoint_id) continue;
    // The destination may have committed and answered just before the connection closed: the
    // final stage's answer decides (the transport fails it if no answer came).
    if (m.final_sent) continue;
    end_out(m, MigrationState::kAbortedByDestination,
            unavailable(fmt::format("kv migrator: the connection to destination {} closed: {}", m.destination,
                                    why.to_string())),
            false);
  }
  for (auto& [id, m] : in) {
    if (m.ended || m.ep.id() != endpoint_id) continue;
    end_in(m, MigrationState::kAbortedByDestination,
           unavailable(fmt::format("kv migrator: the connection to the source of migration {:#x} closed: {}",
                                   id, why.to_string())),
           false, false);
  }
  release_fenced([&](std::uint64_t, const Fenced& f) { return f.ep.id() == endpoint_id; });
}

// ---- device pools ----

void KvMigrator::Impl::drop_link(std::uint64_t id, const Status& why) {
  auto it = links.find(id);
  if (it == links.end()) return;
  it->second.link->abort();
  links.erase(it);
  for (auto& [mid, m] : out) {
    if (!m.ended && m.link == id) end_out(m, MigrationState::kAbortedByDestination, why, true);
  }
  for (auto& [mid, m] : in) {
    if (!m.ended && m.link == id) end_in(m, MigrationState::kAbortedByDestination, why, true, false);
  }
}

void KvMigrator::Impl::advance_links() {
  const Duration now = clock->now();
  std::vector<std::uint64_t> ids;
  for (const auto& [id, l] : links) ids.push_back(id);
  std::vector<std::pair<std::uint64_t, Status>> broken;
  for (std::uint64_t id : ids) {
    // An earlier one's post_receives may have dropped this link.
    auto it = links.find(id);
    if (it == links.end()) continue;
    Link& l = it->second;
    if (!l.joined) {
      auto joined = l.link->joined();
      if (!joined.ok()) {
        broken.emplace_back(id, joined.status().with_context(fmt::format("kv migrator: joining NCCL link {:#x}", id)));
        continue;
      }
      l.joined = *joined;
      if (!l.joined) {
        if (options.stall_timeout != kForever && now >= l.join_deadline) {
          broken.emplace_back(id, deadline_exceeded(fmt::format("kv migrator: the peer did not join NCCL link {:#x} "
                                                                "within the stall timeout",
                                                                id)));
        }
        continue;
      }
    }
    if (l.rank == 1) post_receives(id, l);
  }
  for (auto& [id, why] : broken) drop_link(id, why);
}

// ---- source side ----

void KvMigrator::Impl::end_out(OutMigration& m, MigrationState state, Status reason, bool tell) {
  m.ended = true;
  Draining d{m.ep, {}, MigrationAbort{m.id.value(), MigrationSide::kSource, reason.code(), reason.message()}};
  for (Stage& s : m.stages) {
    for (std::size_t i = s.puts_done; i < s.puts.size(); ++i) {
      if (s.puts[i].valid()) d.puts.push_back(std::move(s.puts[i]));
    }
  }
  if (tell) draining.push_back(std::move(d));
  // The link goes with it (see end_in): sends the destination may never receive would hold its
  // stream.
  if (device) drop_link(m.link, reason);
  ++stats.aborted_out;
  MigrationEvent e;
  e.kind = MigrationEvent::Kind::kAborted;
  e.id = m.id;
  e.outgoing = true;
  e.state = state;
  for (const OutSequence& s : m.seqs) e.sequences.push_back(s.id);
  e.reason = std::move(reason);
  events.push_back(std::move(e));
  record_finished(m.id, state, true);
}

void KvMigrator::Impl::request_pause(OutMigration& m) {
  m.phase = OutPhase::kPaused;
  MigrationEvent e;
  e.kind = MigrationEvent::Kind::kPauseRequested;
  e.id = m.id;
  for (const OutSequence& s : m.seqs) e.sequences.push_back(s.id);
  events.push_back(std::move(e));
}

void KvMigrator::Impl::take_reservation(OutMigration& m, Result<Message> answer) {
  const auto fail = [&](MigrationState state, Status why, bool tell) {
    end_out(m, state, why.with_context(fmt::format("kv migrator: migration {:#x} to {}", m.id.value(),
                                                   m.destination)),
            tell);
  };
  if (!answer.ok()) return fail(blame(answer.status()), answer.status(), true);
  auto r = internal::decode_migration_reservation(answer->body);
  if (!r.ok()) return fail(MigrationState::kAbortedBySource, r.status(), true);
  if (r->refusal) {
    return fail(MigrationState::kAbortedByDestination,
                Status(r->refusal->code, "the destination refused the offer: " + r->refusal->text), false);
  }
  Status taken = take_pages(m, *r);
  if (!taken.ok()) return fail(MigrationState::kAbortedBySource, taken, true);
  m.reserved = true;
  // Paused while the offer was out: everything goes in the final stage.
  if (m.phase != OutPhase::kOffered) return;
  if (options.max_live_stages == 0) {
    request_pause(m);
  } else {
    m.phase = OutPhase::kLive;
  }
}

Status KvMigrator::Impl::take_pages(OutMigration& m, const internal::MigrationReservation& r) {
  const auto bad = [](std::string what) { return data_loss("bad reservation: " + what); };
  if (r.sequences.size() != m.seqs.size()) {
    return bad(fmt::format("{} sequences for {} offered", r.sequences.size(), m.seqs.size()));
  }
  const KvLayout& l = cache->layout();
  if (!device) {
    auto k = RemoteRegion::deserialize(r.k_pool);
    auto v = RemoteRegion::deserialize(r.v_pool);
    if (!k.ok() || !v.ok()) return bad("its pool regions do not decode");
    const std::uint64_t per_page = std::uint64_t(l.num_layers) * std::uint64_t(l.page_bytes());
    if (k->size != v->size || k->size == 0 || k->size % per_page != 0 || k->size / per_page > (1u << 31)) {
      return bad(fmt::format("pools of {} and {} bytes for pages of {} bytes in all layers", k->size, v->size,
                             per_page));
    }
    m.dst_num_pages = std::int64_t(k->size / per_page);
    m.k_remote = std::move(*k);
    m.v_remote = std::move(*v);
  } else {
    // The destination's page ids only shape the runs here; its pool size is its own business.
    m.dst_num_pages = std::int64_t(1) << 31;
    if (r.link == 0) return bad("no NCCL link for device pools");
  }
  std::unordered_set<std::int32_t> seen;
  for (const internal::ReservedSequence& rs : r.sequences) {
    auto it = std::ranges::find_if(m.seqs, [&](const OutSequence& s) { return s.id == rs.sequence; });
    if (it == m.seqs.end() || !it->dst.empty() || rs.pages.size() != it->pages_needed) {
      return bad(fmt::format("sequence {} with {} pages", rs.sequence.value(), rs.pages.size()));
    }
    for (std::int32_t p : rs.pages) {
      if (p < 0 || p >= m.dst_num_pages || !seen.insert(p).second) {
        return bad(fmt::format("page {} of sequence {} in a pool of {} pages, or given twice", p,
                               rs.sequence.value(), m.dst_num_pages));
      }
    }
    it->dst = rs.pages;
  }
  if (!device) return ok_status();
  if (auto it = links.find(r.link); it != links.end()) {
    if (it->second.rank != 0 || it->second.ep.id() != m.ep.id()) {
      return bad(fmt::format("NCCL link {:#x} belongs to another peer or direction", r.link));
    }
  } else {
    auto joined = internal::KvDeviceLink::join(r.link_token, 0, cache->device());
    LAMINAR_RETURN_IF_ERROR(joined.status().with_context(fmt::format("kv migrator: joining NCCL link {:#x}", r.link)));
    Link link;
    link.link = std::move(*joined);
    link.ep = m.ep;
    link.rank = 0;
    link.join_deadline = deadline_after(*clock, options.stall_timeout);
    links.emplace(r.link, std::move(link));
  }
  m.link = r.link;
  return ok_status();
}

void KvMigrator::Impl::check_sequences(OutMigration& m) {
  for (const OutSequence& s : m.seqs) {
    auto pages = cache->pages(s.id);
    if (!pages.ok()) {
      return end_out(m, MigrationState::kAbortedBySource,
                     failed_precondition(fmt::format("kv migrator: sequence {} left the cache while moving",
                                                     s.id.value())),
                     true);
    }
    if (pages->size() > s.pages_needed) {
      return end_out(m, MigrationState::kAbortedBySource,
                     resource_exhausted(fmt::format("kv migrator: sequence {} grew to {} pages, past the {} reserved "
                                                    "at the destination",
                                                    s.id.value(), pages->size(), s.pages_needed)),
                     true);
    }
    // At its reserved pages a sequence cannot grow any more: pause it now.
    if ((m.phase == OutPhase::kOffered || m.phase == OutPhase::kLive) && pages->size() == s.pages_needed) {
      request_pause(m);
    }
  }
}

void KvMigrator::Impl::start_round(OutMigration& m) {
  ++m.live_rounds;
  const std::int32_t page_size = cache->layout().page_size;
  std::uint32_t most = 0;
  for (std::size_t k = 0; k < m.seqs.size(); ++k) {
    OutSequence& s = m.seqs[k];
    const std::int64_t full = *cache->length(s.id) / page_size;
    if (full <= s.staged) continue;
    const auto pages = *cache->pages(s.id);
    Piece p{k, s.staged, std::vector<std::int32_t>(pages.begin() + s.staged, pages.begin() + full)};
    most = std::max(most, std::uint32_t(p.src.size()));
    s.staged = std::uint32_t(full);
    m.todo.push_back(std::move(p));
  }
  if (most <= options.pause_after_pages || m.live_rounds >= options.max_live_stages) request_pause(m);
}

void KvMigrator::Impl::build_stage(OutMigration& m) {
  const KvLayout& l = cache->layout();
  const std::size_t page_bytes = std::size_t(l.page_bytes());
  const std::size_t copy_bytes = 2 * std::size_t(l.num_layers) * page_bytes;  // one page, all layers, both pools
  std::size_t budget = std::max<std::size_t>(1, options.stage_bytes / copy_bytes);
  Stage stage;
  stage.message.migration_id = m.id.value();
  stage.message.stage = m.next_stage++;
  std::vector<std::vector<std::int32_t>> src;  // device pools: this side's pages of each staged sequence
  while (budget > 0 && !m.todo.empty()) {
    Piece& p = m.todo.front();
    const std::size_t n = std::min(budget, p.src.size());
    const OutSequence& s = m.seqs[p.seq];
    StagedSequence staged{s.id, p.first, {}, {}, {}};
    // One put per layer and pool (device pools: one send) for each run of pages consecutive on both
    // sides.
    for (std::size_t i = 0; i < n;) {
      std::size_t run = 1;
      while (i + run < n && p.src[i + run] == p.src[i] + std::int32_t(run) &&
             s.dst[p.first + i + run] == s.dst[p.first + i] + std::int32_t(run)) {
        ++run;
      }
      if (device) {
        staged.runs.push_back(std::uint32_t(run));
        i += run;
        continue;
      }
      for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
        const std::size_t local = (std::size_t(layer) * std::size_t(l.num_pages) + std::size_t(p.src[i])) * page_bytes;
        const std::uint64_t remote =
            (std::uint64_t(layer) * std::uint64_t(m.dst_num_pages) + std::uint64_t(s.dst[p.first + i])) * page_bytes;
        stage.puts.push_back(m.ep.put(k_region, local, m.k_remote, remote, run * page_bytes, options.stall_timeout,
                                      [box = inbox](const Status&) { box->wake(); }));
        stage.puts.push_back(m.ep.put(v_region, local, m.v_remote, remote, run * page_bytes, options.stall_timeout,
                                      [box = inbox](const Status&) { box->wake(); }));
      }
      i += run;
    }
    if (device) {
      staged.checksums.resize(n);  // from the device, before the stage goes
      src.emplace_back(p.src.begin(), p.src.begin() + std::ptrdiff_t(n));
    } else {
      for (std::size_t i = 0; i < n; ++i) staged.checksums.push_back(page_checksum(p.src[i]));
    }
    stage.message.sequences.push_back(std::move(staged));
    stage.pages += n;
    budget -= n;
    if (n == p.src.size()) {
      m.todo.pop_front();
    } else {
      p.src.erase(p.src.begin(), p.src.begin() + std::ptrdiff_t(n));
      p.first += std::uint32_t(n);
    }
  }
  if (m.phase == OutPhase::kFinal && m.todo.empty()) {
    // The last stage: every sequence, with its state.
    stage.message.final = true;
    for (std::size_t k = 0; k < m.seqs.size(); ++k) {
      auto it = std::ranges::find_if(stage.message.sequences,
                                     [&](const StagedSequence& x) { return x.sequence == m.seqs[k].id; });
      if (it == stage.message.sequences.end()) {
        stage.message.sequences.push_back(StagedSequence{m.seqs[k].id, m.seqs[k].staged, {}, {}, {}});
        src.emplace_back();
        it = stage.message.sequences.end() - 1;
      }
      it->state = m.states[k];
    }
    m.final_sent = true;
  }
  if (device) {
    std::vector<std::int32_t> pages;
    for (const auto& v : src) pages.insert(pages.end(), v.begin(), v.end());
    stage.spans = device_spans(stage.message, [&](std::size_t k, std::uint32_t i) { return src[k][i]; });
    auto link = links.find(m.link);
    auto sums = link == links.end() ? Result<std::unique_ptr<internal::KvDeviceWork>>(
                                          unavailable(fmt::format("kv migrator: NCCL link {:#x} is gone", m.link)))
                                    : link->second.link->post({}, device_pools, pages);
    if (!sums.ok()) {
      // Nothing of this stage is on the wire: the migration ends here, its sequences stay.
      m.stages.push_back(std::move(stage));
      return end_out(m, MigrationState::kAbortedBySource,
                     sums.status().with_context(fmt::format("kv migrator: migration {:#x}", m.id.value())), true);
    }
    stage.sums = std::move(*sums);
  }
  m.stages.push_back(std::move(stage));
}

bool KvMigrator::Impl::settle_stages(OutMigration& m) {
  bool progress = false;
  // A stage goes out once its puts landed (the destination checks pages that are there), and in
  // order (the destination takes stage numbers in order).
  for (Stage& s : m.stages) {
    if (s.sent) continue;
    while (s.puts_done < s.puts.size() && ready(s.puts[s.puts_done])) {
      const Status put = s.puts[s.puts_done].get();
      if (!put.ok()) {
        if (put.code() == StatusCode::kInvalidArgument) record_error(put);
        end_out(m, blame(put), put.with_context(fmt::format("kv migrator: migration {:#x}: a put to {}", m.id.value(),
                                                            m.destination)),
                true);
        return false;
      }
      ++s.puts_done;
    }
    if (s.puts_done < s.puts.size()) break;
    if (device && !device_stage_ready(m, s)) {
      if (m.ended) return false;
      break;
    }
    const KvLayout& l = cache->layout();
    stats.pages_sent += s.pages;
    stats.bytes_sent += s.pages * 2 * std::uint64_t(l.num_layers) * std::uint64_t(l.page_bytes());
    s.answer = internal::request_protocol_async(m.ep, Message{kStage, internal::encode_migration_stage(s.message)},
                                                options.stall_timeout, [box = inbox] { box->wake(); });
    s.sent = true;
    s.sent_at = clock->now();
    progress = true;
    if (device) {
      // After the message, so the destination learns of the sends no later than they start.
      auto sends = links.at(m.link).link->post(s.spans, device_pools, {});
      if (!sends.ok()) {
        drop_link(m.link, sends.status().with_context(fmt::format("kv migrator: migration {:#x}: sending stage {}",
                                                                  m.id.value(), s.message.stage)));
        return false;
      }
      s.sends = std::move(*sends);
    }
  }
  while (!m.stages.empty() && m.stages.front().sent) {
    Stage& s = m.stages.front();
    if (!ready(s.answer)) {
      if (options.stall_timeout != kForever && clock->now() - s.sent_at >= options.stall_timeout) {
        end_out(m, MigrationState::kAbortedBySource,
                deadline_exceeded(fmt::format("kv migrator: migration {:#x}: {} left stage {} unanswered",
                                              m.id.value(), m.destination, s.message.stage)),
                true);
        return false;
      }
      break;
    }
    auto reply = s.answer.get();
    const std::string what = fmt::format("kv migrator: migration {:#x}: stage {} at {}", m.id.value(),
                                         s.message.stage, m.destination);
    if (!reply.ok()) {
      if (reply.status().code() == StatusCode::kInvalidArgument) record_error(reply.status());
      end_out(m, blame(reply.status()), reply.status().with_context(what), true);
      return false;
    }
    auto answer = internal::decode_migration_stage_answer(reply->body);
    if (!answer.ok()) {
      end_out(m, MigrationState::kAbortedBySource, answer.status().with_context(what), true);
      return false;
    }
    if (answer->refusal) {
      end_out(m, MigrationState::kAbortedByDestination,
              Status(answer->refusal->code, fmt::format("{}: refused: {}", what, answer->refusal->text)), true);
      return false;
    }
    if (answer->stage != s.message.stage) {
      end_out(m, MigrationState::kAbortedBySource, data_loss(fmt::format("{}: answered as stage {}", what,
                                                                          answer->stage)),
              true);
      return false;
    }
    const bool final = s.message.final;
    m.stages.pop_front();
    progress = true;
    if (final) {
      // The destination holds the sequences now: let them go here.
      m.ended = true;
      MigrationEvent e;
      e.kind = MigrationEvent::Kind::kDone;
      e.id = m.id;
      e.state = MigrationState::kDone;
      for (const OutSequence& q : m.seqs) {
        (void)cache->release(q.id);
        e.sequences.push_back(q.id);
      }
      events.push_back(std::move(e));
      ++stats.done_out;
      record_finished(m.id, MigrationState::kDone, true);
      return false;
    }
  }
  return progress;
}

bool KvMigrator::Impl::device_stage_ready(OutMigration& m, Stage& s) {
  auto it = links.find(m.link);
  if (it == links.end()) {
    end_out(m, MigrationState::kAbortedByDestination,
            unavailable(fmt::format("kv migrator: migration {:#x}: its NCCL link {:#x} is gone", m.id.value(), m.link)),
            true);
    return false;
  }
  // advance_links() polls a joining link.
  if (!it->second.joined) return false;
  auto done = s.sums->done();
  if (!done.ok()) {
    drop_link(m.link, done.status().with_context(fmt::format("kv migrator: migration {:#x}: checksums of stage {}",
                                                             m.id.value(), s.message.stage)));
    return false;
  }
  if (!*done) return false;
  const std::vector<std::uint64_t>& sums = s.sums->checksums();
  std::size_t j = 0;
  for (StagedSequence& q : s.message.sequences) {
    for (std::uint64_t& c : q.checksums) c = sums[j++];
  }
  s.message.batch = it->second.next_batch++;
  return true;
}

void KvMigrator::Impl::advance_out(OutMigration& m) {
  if (!m.reserved) {
    if (!ready(m.offer_answer)) {
      if (options.stall_timeout != kForever && clock->now() - m.offer_sent_at >= options.stall_timeout) {
        end_out(m, MigrationState::kAbortedBySource,
                deadline_exceeded(fmt::format("kv migrator: migration {:#x}: {} left the offer unanswered",
                                              m.id.value(), m.destination)),
                true);
        return;
      }
      // The host decodes while the offer is out: a sequence that fills its pages pauses now.
      if (m.phase == OutPhase::kOffered) check_sequences(m);
      return;
    }
    take_reservation(m, m.offer_answer.get());
    if (m.ended || !m.reserved) return;
  }
  if (m.phase != OutPhase::kFinal) {
    check_sequences(m);
    if (m.ended) return;
  }
  // While the host decodes, one poll() builds (and checksums) one stage at most, so a decode step
  // waits for one stage's checksums at most; once paused, the copy goes as fast as it can.
  bool built = false;
  for (;;) {
    bool progress = settle_stages(m);
    if (m.ended) return;
    if (m.phase == OutPhase::kLive && m.todo.empty() && m.stages.empty()) {
      start_round(m);
      progress = true;
    }
    while (m.stages.size() < kStagesInFlight && !m.final_sent &&
           (!m.todo.empty() || m.phase == OutPhase::kFinal) && !(built && m.phase == OutPhase::kLive)) {
      build_stage(m);
      if (m.ended) return;
      built = progress = true;
    }
    if (!progress) break;
  }
}

void KvMigrator::Impl::on_abort_for_source(const MigrationAbort& a, const Endpoint& from) {
  auto it = out.find(a.migration_id);
  if (it == out.end() || it->second.ended || it->second.ep.id() != from.id()) return;
  // The destination aborts only what it has not committed, so even after our final stage the
  // sequences are still ours alone.
  // Told back once our puts in flight landed: the destination holds the pages until then.
  end_out(it->second, MigrationState::kAbortedByDestination,
          Status(a.code, fmt::format("kv migrator: migration {:#x}: destination {} aborted: {}", a.migration_id,
                                     it->second.destination, a.reason)),
          true);
}

// ---- public ----

Result<std::unique_ptr<KvMigrator>> KvMigrator::create(std::shared_ptr<Transport> transport,
                                                       std::shared_ptr<PagedKvCache> cache,
                                                       KvMigratorOptions options) {
  if (!transport) return invalid_argument("kv migrator: the transport is null");
  if (!cache) return invalid_argument("kv migrator: the cache is null");
  const auto positive = [](std::string_view name, Duration d) -> Status {
    if (d <= Duration::zero()) return invalid_argument(fmt::format("kv migrator: {} is {} ns", name, d.count()));
    return ok_status();
  };
  LAMINAR_RETURN_IF_ERROR(positive("lease", options.lease));
  LAMINAR_RETURN_IF_ERROR(positive("connect_timeout", options.connect_timeout));
  LAMINAR_RETURN_IF_ERROR(positive("stall_timeout", options.stall_timeout));
  if (options.stage_bytes == 0) return invalid_argument("kv migrator: stage_bytes is 0");
  if (options.max_sequences == 0) return invalid_argument("kv migrator: max_sequences is 0");
  if (options.max_migrations == 0) return invalid_argument("kv migrator: max_migrations is 0");
  if (!cache->device().is_host()) LAMINAR_RETURN_IF_ERROR(internal::kv_device_pools_usable(cache->device()));
  const std::size_t bytes = std::size_t(cache->layout().pool_bytes());
  if (options.k_pool_region.valid() != options.v_pool_region.valid()) {
    return invalid_argument("kv migrator: a region for one pool and none for the other");
  }
  for (const auto& [name, region, pool] : {std::tuple{"k", &options.k_pool_region, cache->k_pool().data()},
                                           std::tuple{"v", &options.v_pool_region, cache->v_pool().data()}}) {
    if (!region->valid()) continue;
    if (!transport->owns(*region)) {
      return invalid_argument(fmt::format("kv migrator: the {} pool's region belongs to another transport", name));
    }
    if (region->data() != pool || region->size() != bytes) {
      return invalid_argument(fmt::format("kv migrator: the {} pool's region is {} bytes at {}, the pool {} bytes at {}",
                                          name, region->size(), static_cast<void*>(region->data()), bytes, pool));
    }
  }
  Result<internal::TransportClaim> claim = internal::TransportClaim::take(*transport, "kv migrator");
  if (!claim.ok()) return claim.status();
  auto impl = std::make_unique<Impl>(std::move(transport), std::move(cache), std::move(options));
  impl->claim = std::move(*claim);
  const KvLayout& l = impl->cache->layout();
  if (!impl->cache->device().is_host()) {
    // Device pools are not registered with the transport: their pages go by NCCL.
    impl->device = true;
    impl->k_base = static_cast<std::byte*>(impl->cache->k_pool().data());
    impl->v_base = static_cast<std::byte*>(impl->cache->v_pool().data());
    impl->device_pools = {impl->k_base, impl->v_base, l.num_pages, l.page_bytes(), l.num_layers};
  } else {
    Result<MemoryRegion> k = impl->options.k_pool_region;
    Result<MemoryRegion> v = impl->options.v_pool_region;
    if (!impl->options.k_pool_region.valid()) {
      k = impl->transport->register_memory(impl->cache->k_pool().data(), bytes);
      v = k.ok() ? impl->transport->register_memory(impl->cache->v_pool().data(), bytes) : k;
    }
    if (!v.ok()) return v.status().with_context("kv migrator: registering the cache's pools");
    impl->k_region = std::move(*k);
    impl->v_region = std::move(*v);
  }
  Impl* p = impl.get();
  p->clock_wake = p->clock->subscribe([box = p->inbox] { box->wake(); });
  for (MessageType type : {kOffer, kStage, kAbort}) {
    // The types are laminar's own, in the reserved range: registering them cannot fail.
    LAMINAR_CHECK(internal::on_protocol_message(*p->transport, type,
                                                p->gate.wrap([p](Incoming in) { p->queue(std::move(in)); }))
                      .ok());
  }
  return std::unique_ptr<KvMigrator>(new KvMigrator(std::move(impl)));
}

Result<KvMigrator::AllocatedCache> KvMigrator::allocate_cache(Transport& transport, const KvLayout& layout) {
  LAMINAR_RETURN_IF_ERROR(validate(layout).with_context("kv migrator: allocate_cache()"));
  const std::size_t bytes = std::size_t(layout.pool_bytes());
  auto k = transport.allocate(bytes);
  if (!k.ok()) return k.status().with_context("kv migrator: allocating the k pool");
  auto v = transport.allocate(bytes);
  if (!v.ok()) return v.status().with_context("kv migrator: allocating the v pool");
  // Zero-filled as PagedKvCache::create(layout) fills its own, and touched now rather than by a put.
  std::memset(k->data(), 0, bytes);
  std::memset(v->data(), 0, bytes);
  const std::int64_t shape[] = {layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads,
                                layout.head_dim};
  // The layout was validated and the memory is there, so the views are well formed.
  auto k_view = TensorView::contiguous(k->data(), layout.dtype, shape);
  auto v_view = TensorView::contiguous(v->data(), layout.dtype, shape);
  LAMINAR_CHECK(k_view.ok() && v_view.ok());
  auto cache = PagedKvCache::create(layout, *k_view, *v_view);
  if (!cache.ok()) return cache.status().with_context("kv migrator: allocate_cache()");
  // The cache owns the regions, so the memory it views lives as long as it does.
  struct Owner {
    MemoryRegion k, v;
    PagedKvCache cache;
  };
  auto owner = std::make_shared<Owner>(Owner{*k, *v, std::move(*cache)});
  return AllocatedCache{std::shared_ptr<PagedKvCache>(owner, &owner->cache), *k, *v};
}

KvMigrator::KvMigrator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvMigrator::~KvMigrator() {
  Impl& d = *impl_;
  for (MessageType type : {kOffer, kStage, kAbort}) (void)internal::on_protocol_message(*d.transport, type, {});
  // A handler that started before its removal finishes before anything it uses goes.
  d.gate.close();
  std::lock_guard lock(d.mu);
  // Bounded in real time (Clock::steady()) whatever options.clock is: a virtual clock that stands
  // still must not hang the destructor, and the peers' own leases and stall timeouts cover what is
  // cut short.
  const std::shared_ptr<Clock> real = Clock::steady();
  const Duration shutdown_at = deadline_after(*real, kShutdownBudget);
  const auto left = [&] { return std::min(internal::kMigrationAbortSendTimeout, shutdown_at - real->now()); };
  for (auto& [id, m] : d.out) {
    if (!m.ended) d.end_out(m, MigrationState::kAbortedBySource, cancelled("kv migrator: the source shut down"), true);
  }
  for (auto& [id, m] : d.in) {
    if (!m.ended) {
      d.end_in(m, MigrationState::kAbortedByDestination, cancelled("kv migrator: the destination shut down"), false,
               false);
    }
  }
  d.release_fenced([](std::uint64_t, const Impl::Fenced&) { return true; });
  for (auto& [id, m] : d.in) {
    d.send_abort(m.ep, MigrationAbort{id, MigrationSide::kDestination, StatusCode::kCancelled,
                                      "kv migrator: the destination shut down"},
                 left());
  }
  for (Impl::Draining& dr : d.draining) {
    for (auto& f : dr.puts) {
      // A std::future wakes no condition variable: its own wait, for what is left of the budget.
      const Duration wait = shutdown_at - real->now();
      if (wait <= Duration::zero() || f.wait_for(wait) != std::future_status::ready) break;
    }
    d.send_abort(dr.ep, dr.message, left());
  }
  d.draining.clear();
  d.out.clear();
  d.in.clear();
  // After the migrations' work: a link's end aborts what is still in flight on it.
  d.links.clear();
  // Our own connections: closing them cancels whatever is still pending on them.
  for (auto& [addr, ep] : d.connections) ep.close();
  d.connections.clear();
  d.watches.clear();
  std::lock_guard inbox_lock(d.inbox->mu);
  d.inbox->items.clear();
  d.inbox->messages = 0;
  d.claim.release();
}

void KvMigrator::set_version(Version v) {
  std::lock_guard lock(impl_->mu);
  impl_->version = v;
}

Version KvMigrator::version() const {
  std::lock_guard lock(impl_->mu);
  return impl_->version;
}

Result<MigrationId> KvMigrator::migrate(std::string_view destination, std::span<const SequenceId> sequences) {
  Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  if (sequences.empty()) return invalid_argument("kv migrator: migrate() of no sequences");
  if (sequences.size() > internal::kMaxMigrationSequences) {
    return invalid_argument(fmt::format("kv migrator: migrate() of {} sequences, above {}", sequences.size(),
                                        internal::kMaxMigrationSequences));
  }
  std::unordered_set<SequenceId> moving;
  for (const auto& [id, m] : d.out) {
    for (const auto& s : m.seqs) moving.insert(s.id);
  }
  const KvLayout& l = d.cache->layout();
  std::unordered_set<SequenceId> seen;
  internal::MigrationOffer offer;
  std::vector<Impl::OutSequence> seqs;
  for (SequenceId id : sequences) {
    if (!seen.insert(id).second) {
      return invalid_argument(fmt::format("kv migrator: sequence {} given twice", id.value()));
    }
    auto length = d.cache->length(id);
    if (!length.ok()) return not_found(fmt::format("kv migrator: sequence {} is not in the cache", id.value()));
    if (moving.contains(id)) {
      return failed_precondition(fmt::format("kv migrator: sequence {} is already moving", id.value()));
    }
    const std::uint64_t pages = d.cache->pages(id)->size() + std::uint64_t(d.options.growth_pages);
    if (std::uint64_t(*length) > internal::kMaxMigrationTokens || pages > internal::kMaxMigrationPages) {
      return invalid_argument(fmt::format("kv migrator: sequence {} of {} tokens and {} pages is too long to move",
                                          id.value(), *length, pages));
    }
    offer.sequences.push_back({id, std::uint64_t(*length), std::uint32_t(pages)});
    seqs.push_back(Impl::OutSequence{id, std::uint32_t(pages), {}, 0});
  }
  if (d.out.size() >= d.options.max_migrations) {
    return unavailable(fmt::format("kv migrator: {} outgoing migrations running, max_migrations {}", d.out.size(),
                                   d.options.max_migrations));
  }
  Endpoint ep;
  if (auto it = d.connections.find(std::string(destination)); it != d.connections.end() && it->second.status().ok()) {
    ep = it->second;
  } else {
    auto connected = d.transport->connect(destination, d.options.connect_timeout);
    if (!connected.ok()) {
      return connected.status().with_context(fmt::format("kv migrator: connecting to {}", destination));
    }
    ep = *connected;
    d.connections[std::string(destination)] = ep;
  }
  d.watch(ep);
  std::uint64_t id = 0;
  while (id == 0 || d.out.contains(id) || d.in.contains(id) || d.finished.contains(id)) id = d.rng();
  offer.migration_id = id;
  offer.version = d.version;
  offer.layout = {l.num_layers, l.page_size, l.num_kv_heads, l.head_dim, l.dtype};
  offer.pools = d.device ? internal::KvPools::kDevice : internal::KvPools::kHost;
  Impl::OutMigration m;
  m.id = MigrationId(id);
  m.destination = std::string(destination);
  m.ep = ep;
  m.version = d.version;
  m.seqs = std::move(seqs);
  m.offer_sent_at = d.clock->now();
  m.offer_answer = internal::request_protocol_async(ep, Message{kOffer, internal::encode_migration_offer(offer)},
                                                    d.options.stall_timeout, [box = d.inbox] { box->wake(); });
  d.out.emplace(id, std::move(m));
  ++d.stats.migrations_out;
  return MigrationId(id);
}

std::vector<MigrationEvent> KvMigrator::poll() {
  Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  std::deque<Impl::Inbound> arrived;
  {
    std::lock_guard inbox_lock(d.inbox->mu);
    arrived.swap(d.inbox->items);
    d.inbox->messages = 0;
    d.inbox->woken = false;
  }
  for (Impl::Inbound& a : arrived) {
    if (a.closed) {
      d.on_closed(a.endpoint_id, a.why);
      continue;
    }
    switch (a.in.message.type) {
      case kOffer: d.on_offer(a.in); break;
      case kStage: d.on_stage(a.in); break;
      case kAbort: {
        // One-way: a body that does not decode is dropped.
        auto m = internal::decode_migration_abort(a.in.message.body);
        if (!m.ok()) break;
        if (m->side == MigrationSide::kSource) {
          d.on_abort_for_destination(*m, a.in.from);
        } else {
          d.on_abort_for_source(*m, a.in.from);
        }
        break;
      }
      default: break;
    }
  }
  d.expire_leases();
  if (d.device) {
    d.advance_links();
    for (auto& [id, m] : d.in) {
      if (!m.ended) d.check_received(m);
    }
  }
  for (auto& [id, m] : d.out) {
    if (!m.ended) d.advance_out(m);
  }
  std::erase_if(d.draining, [&](Impl::Draining& dr) {
    if (!std::ranges::all_of(dr.puts, [](const auto& f) { return ready(f); })) return false;
    d.send_abort(dr.ep, dr.message, internal::kMigrationAbortSendTimeout);
    return true;
  });
  d.sweep();
  return std::exchange(d.events, {});
}

std::vector<MigrationEvent> KvMigrator::wait_event(Duration timeout) {
  Impl& d = *impl_;
  const Duration deadline = deadline_after(*d.clock, timeout);
  for (;;) {
    std::vector<MigrationEvent> events = poll();
    if (!events.empty() || d.clock->now() >= deadline) return events;
    const Duration until = std::min(deadline, poll_deadline());
    std::unique_lock lock(d.inbox->mu);
    internal::wait_until(*d.clock, d.inbox->cv, lock, until, [&] { return d.inbox->woken; });
  }
}

void KvMigrator::set_notify(std::function<void()> notify) {
  std::lock_guard lock(impl_->inbox->notify_mu);
  impl_->inbox->notify = std::move(notify);
}

Duration KvMigrator::poll_deadline() const {
  std::lock_guard lock(impl_->mu);
  return impl_->next_deadline();
}

Status KvMigrator::finish(MigrationId id, std::vector<SequenceState> states) {
  Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  auto it = d.out.find(id.value());
  if (it == d.out.end() || it->second.ended) {
    return not_found(fmt::format("kv migrator: no outgoing migration {:#x} is running", id.value()));
  }
  Impl::OutMigration& m = it->second;
  if (m.phase != Impl::OutPhase::kPaused) {
    return failed_precondition(fmt::format("kv migrator: migration {:#x} is not waiting for its states", id.value()));
  }
  // A sequence that left the cache or outgrew its reservation cannot move in this migration.
  d.check_sequences(m);
  if (m.ended) {
    Status why = d.events.back().reason;
    d.sweep();
    return why;
  }
  const std::string what = fmt::format("kv migrator: finish() of migration {:#x}", id.value());
  std::vector<SequenceState> by_index(m.seqs.size());
  std::vector<bool> given(m.seqs.size(), false);
  std::size_t message_bytes = 64;
  for (SequenceState& s : states) {
    auto k = std::ranges::find_if(m.seqs, [&](const Impl::OutSequence& q) { return q.id == s.sequence; });
    if (k == m.seqs.end()) {
      return invalid_argument(fmt::format("{}: sequence {} is not in it", what, s.sequence.value()));
    }
    const std::size_t i = std::size_t(k - m.seqs.begin());
    if (given[i]) return invalid_argument(fmt::format("{}: sequence {} given twice", what, s.sequence.value()));
    const std::int64_t length = *d.cache->length(s.sequence);
    if (s.kv_length != std::uint64_t(length)) {
      return invalid_argument(fmt::format("{}: sequence {} has kv_length {}, the cache holds {} tokens", what,
                                          s.sequence.value(), s.kv_length, length));
    }
    if (s.version != m.version) {
      return invalid_argument(fmt::format("{}: sequence {} is of version {}, the migration of version {}", what,
                                          s.sequence.value(), s.version.value(), m.version.value()));
    }
    // What the destination's decoder would refuse, refused here where the host can fix it.
    const MigrationStage alone{id.value(), 0, true, {StagedSequence{s.sequence, 0, {}, s, {}}}};
    const std::vector<std::byte> body = internal::encode_migration_stage(alone);
    LAMINAR_RETURN_IF_ERROR(internal::decode_migration_stage(body).status().with_context(what));
    message_bytes += body.size() + 8 * std::size_t(m.seqs[i].pages_needed);
    given[i] = true;
    by_index[i] = std::move(s);
  }
  for (std::size_t i = 0; i < m.seqs.size(); ++i) {
    if (!given[i]) return invalid_argument(fmt::format("{}: no state for sequence {}", what, m.seqs[i].id.value()));
  }
  if (message_bytes > d.transport->options().max_message_bytes) {
    return resource_exhausted(fmt::format("{}: the final stage would take {} bytes, above the transport's {}", what,
                                          message_bytes, d.transport->options().max_message_bytes));
  }
  const std::int32_t page_size = d.cache->layout().page_size;
  // The rest of every sequence after the pages already queued: its full pages since the last live
  // stage and its last, partly filled one. A sequence keeps one piece, so it appears once a stage.
  for (std::size_t i = 0; i < m.seqs.size(); ++i) {
    Impl::OutSequence& s = m.seqs[i];
    const std::int64_t need = pages_for(std::int64_t(by_index[i].kv_length), page_size);
    if (need <= s.staged) continue;
    const auto pages = *d.cache->pages(s.id);
    auto piece = std::ranges::find_if(m.todo, [&](const Impl::Piece& p) { return p.seq == i; });
    if (piece == m.todo.end()) piece = m.todo.insert(m.todo.end(), Impl::Piece{i, s.staged, {}});
    piece->src.insert(piece->src.end(), pages.begin() + s.staged, pages.begin() + need);
    s.staged = std::uint32_t(need);
  }
  m.states = std::move(by_index);
  m.phase = Impl::OutPhase::kFinal;
  d.advance_out(m);
  d.sweep();
  return ok_status();
}

Status KvMigrator::abort(MigrationId id, std::string_view reason) {
  Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  if (auto it = d.out.find(id.value()); it != d.out.end() && !it->second.ended) {
    if (it->second.final_sent) {
      return failed_precondition(
          fmt::format("kv migrator: migration {:#x}: the final stage is sent; the destination decides", id.value()));
    }
    d.end_out(it->second, MigrationState::kAbortedBySource,
              aborted(fmt::format("kv migrator: migration {:#x} aborted by its source: {}", id.value(), reason)),
              true);
    d.sweep();
    return ok_status();
  }
  if (auto it = d.in.find(id.value()); it != d.in.end() && !it->second.ended) {
    d.end_in(it->second, MigrationState::kAbortedByDestination,
             aborted(fmt::format("kv migrator: migration {:#x} aborted by its destination: {}", id.value(), reason)),
             true, true);
    d.sweep();
    return ok_status();
  }
  if (auto it = d.finished.find(id.value()); it != d.finished.end() && it->second.state == MigrationState::kDone) {
    return failed_precondition(fmt::format("kv migrator: migration {:#x} is done", id.value()));
  }
  return not_found(fmt::format("kv migrator: no migration {:#x} is running", id.value()));
}

Result<MigrationState> KvMigrator::state(MigrationId id) const {
  const Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  if (auto it = d.out.find(id.value()); it != d.out.end() && !it->second.ended) return MigrationState::kRunning;
  if (auto it = d.in.find(id.value()); it != d.in.end() && !it->second.ended) return MigrationState::kRunning;
  if (auto it = d.finished.find(id.value()); it != d.finished.end()) return it->second.state;
  return not_found(fmt::format("kv migrator: no migration {:#x}", id.value()));
}

std::vector<SequenceId> KvMigrator::moving() const {
  const Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  std::vector<SequenceId> ids;
  for (const auto& [id, m] : d.out) {
    if (m.ended) continue;
    for (const auto& s : m.seqs) ids.push_back(s.id);
  }
  for (const auto& [id, m] : d.in) {
    if (m.ended) continue;
    for (const auto& s : m.seqs) ids.push_back(s.id);
  }
  return ids;
}

std::optional<std::string> KvMigrator::address() const { return impl_->transport->listen_address(); }

KvMigratorStats KvMigrator::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

Status KvMigrator::background_error() const {
  std::lock_guard lock(impl_->mu);
  return impl_->first_error;
}

}  // namespace laminar
