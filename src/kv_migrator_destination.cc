// KvMigrator, destination side (see kv_migrator.h): answers offers with reserved pages, checks
// each stage's pages against their checksums, commits the final stage, and returns the pages of
// a migration that stops short of it.
#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

#include "kv_migrator_impl.h"
#include "transport/protocol.h"

namespace laminar {

namespace {

using internal::MigrationAbort;
using internal::MigrationOffer;
using internal::MigrationRefusal;
using internal::MigrationReservation;
using internal::MigrationSide;
using internal::MigrationStage;
using internal::MigrationStageAnswer;

constexpr MessageType kOffer = internal::kMigrationOfferMessage;
constexpr MessageType kStage = internal::kMigrationStageMessage;

Message refusal_reservation(const Status& why) {
  MigrationReservation r;
  r.refusal = MigrationRefusal{why.code(), why.message()};
  return Message{kOffer, internal::encode_migration_reservation(r)};
}

Message refusal_answer(const Status& why) {
  MigrationStageAnswer a;
  a.refusal = MigrationRefusal{why.code(), why.message()};
  return Message{kStage, internal::encode_migration_stage_answer(a)};
}

}  // namespace

Status KvMigrator::Impl::check_offer(const MigrationOffer& offer) const {
  const std::string what = fmt::format("kv migrator: offer of migration {:#x}", offer.migration_id);
  if (offer.sequences.empty()) return invalid_argument(fmt::format("{}: no sequences", what));
  if (out.contains(offer.migration_id) || in.contains(offer.migration_id)) {
    return already_exists(fmt::format("{}: a migration of that id is running here", what));
  }
  if (offer.version != version) {
    return failed_precondition(fmt::format("{}: version {}, this worker holds version {}", what,
                                           offer.version.value(), version.value()));
  }
  const KvLayout& l = cache->layout();
  const internal::KvLayoutFingerprint mine{l.num_layers, l.page_size, l.num_kv_heads, l.head_dim, l.dtype};
  if (!(offer.layout == mine)) {
    return failed_precondition(fmt::format(
        "{}: layout of {} layers, page_size {}, {} kv heads, head_dim {}, {}; this worker's is {}, {}, {}, {}, {}",
        what, offer.layout.num_layers, offer.layout.page_size, offer.layout.num_kv_heads, offer.layout.head_dim,
        dtype_name(offer.layout.dtype), l.num_layers, l.page_size, l.num_kv_heads, l.head_dim, dtype_name(l.dtype)));
  }
  const internal::KvPools pools = device ? internal::KvPools::kDevice : internal::KvPools::kHost;
  if (offer.pools != pools) {
    const auto where = [](internal::KvPools p) { return p == internal::KvPools::kDevice ? "device" : "host"; };
    return failed_precondition(fmt::format("{}: the source's pools are in {} memory, this worker's in {} memory", what,
                                           where(offer.pools), where(pools)));
  }
  std::size_t incoming_sequences = 0;
  std::unordered_set<SequenceId> arriving;
  for (const auto& [id, m] : in) {
    incoming_sequences += m.seqs.size();
    for (const InSequence& s : m.seqs) arriving.insert(s.id);
  }
  if (in.size() >= options.max_migrations) {
    return unavailable(fmt::format("{}: {} incoming migrations running, max_migrations {}", what, in.size(),
                                   options.max_migrations));
  }
  std::unordered_set<SequenceId> offered;
  std::uint64_t pages = 0;
  for (const internal::OfferedSequence& s : offer.sequences) {
    if (!offered.insert(s.sequence).second) {
      return invalid_argument(fmt::format("{}: sequence {} offered twice", what, s.sequence.value()));
    }
    if (cache->length(s.sequence).ok() || arriving.contains(s.sequence)) {
      return already_exists(fmt::format("{}: sequence {} is already here", what, s.sequence.value()));
    }
    pages += s.pages_needed;
  }
  if (cache->num_sequences() + incoming_sequences + offer.sequences.size() > options.max_sequences) {
    return resource_exhausted(fmt::format("{}: {} sequences live and {} arriving here, {} more is past {} slots", what,
                                          cache->num_sequences(), incoming_sequences, offer.sequences.size(),
                                          options.max_sequences));
  }
  if (pages > std::uint64_t(cache->free_pages())) {
    return resource_exhausted(fmt::format("{}: {} pages needed, {} free", what, pages, cache->free_pages()));
  }
  return ok_status();
}

void KvMigrator::Impl::on_offer(Incoming& msg) {
  auto offer = internal::decode_migration_offer(msg.message.body);
  if (!offer.ok()) {
    ++stats.offers_refused;
    (void)msg.from.reply_error(msg, offer.status());
    return;
  }
  if (Status why = check_offer(*offer); !why.ok()) {
    ++stats.offers_refused;
    (void)msg.from.reply(msg, refusal_reservation(why));
    return;
  }
  InMigration m;
  m.id = MigrationId(offer->migration_id);
  m.ep = msg.from;
  MigrationReservation r;
  r.lease_ns = std::uint64_t(options.lease.count());
  if (device) {
    auto link = receive_link(msg.from);
    if (!link.ok()) {
      ++stats.offers_refused;
      (void)msg.from.reply(msg, refusal_reservation(link.status()));
      return;
    }
    m.link = *link;
    r.link = *link;
    r.link_token = links.at(*link).token;
  }
  for (const internal::OfferedSequence& s : offer->sequences) {
    InSequence q{s.sequence, {}, 0};
    if (s.pages_needed > 0) {
      // check_offer counted the free pages.
      auto pages = cache->reserve_pages(std::int32_t(s.pages_needed));
      LAMINAR_CHECK_MSG(pages.ok(), pages.status().to_string());
      q.pages = std::move(*pages);
    }
    r.sequences.push_back({q.id, q.pages});
    m.seqs.push_back(std::move(q));
  }
  if (!device) {
    r.k_pool = k_region.remote().serialize();
    r.v_pool = v_region.remote().serialize();
  }
  if (!msg.from.reply(msg, Message{kOffer, internal::encode_migration_reservation(r)}).ok()) {
    // The source is gone before it heard of any page: nothing ever started.
    for (const InSequence& q : m.seqs) LAMINAR_CHECK(cache->unreserve_pages(q.pages).ok());
    return;
  }
  m.deadline = deadline_after(*clock, options.lease);
  watch(m.ep);
  ++stats.migrations_in;
  in.emplace(offer->migration_id, std::move(m));
}

Status KvMigrator::Impl::check_stage(const InMigration& m, const MigrationStage& stage) const {
  const std::string what = fmt::format("kv migrator: stage {} of migration {:#x}", stage.stage, stage.migration_id);
  if (stage.stage != m.next_stage) {
    return failed_precondition(fmt::format("{}: expected stage {}", what, m.next_stage));
  }
  if ((stage.batch != 0) != device) {
    return invalid_argument(fmt::format("{}: its pages came by {}, this worker's pools are in {} memory", what,
                                        stage.batch != 0 ? "NCCL" : "put", device ? "device" : "host"));
  }
  std::unordered_set<SequenceId> seen;
  for (const internal::StagedSequence& s : stage.sequences) {
    auto it = std::ranges::find_if(m.seqs, [&](const InSequence& q) { return q.id == s.sequence; });
    if (it == m.seqs.end()) {
      return invalid_argument(fmt::format("{}: sequence {} is not in it", what, s.sequence.value()));
    }
    if (!seen.insert(s.sequence).second) {
      return invalid_argument(fmt::format("{}: sequence {} appears twice", what, s.sequence.value()));
    }
    if (s.first_page != it->received || std::uint64_t(s.first_page) + s.checksums.size() > it->pages.size()) {
      return invalid_argument(fmt::format("{}: sequence {} pages {} to {}, after {} received of {} reserved", what,
                                          s.sequence.value(), s.first_page, s.first_page + s.checksums.size(),
                                          it->received, it->pages.size()));
    }
    // A run is one transfer per layer and pool: its pages must be consecutive here too.
    std::uint32_t at = s.first_page;
    for (std::uint32_t run : s.runs) {
      for (std::uint32_t i = 1; i < run; ++i) {
        if (it->pages[at + i] != it->pages[at] + std::int32_t(i)) {
          return invalid_argument(fmt::format("{}: sequence {} has a run of {} pages from page {}, not consecutive "
                                              "here",
                                              what, s.sequence.value(), run, at));
        }
      }
      at += run;
    }
  }
  if (stage.final && seen.size() != m.seqs.size()) {
    return invalid_argument(fmt::format("{}: the final stage has {} of its {} sequences", what, seen.size(),
                                        m.seqs.size()));
  }
  return ok_status();
}

Status KvMigrator::Impl::check_final(const InMigration& m, const MigrationStage& stage) const {
  const std::string what = fmt::format("kv migrator: final stage of migration {:#x}", stage.migration_id);
  const std::int32_t page_size = cache->layout().page_size;
  for (const internal::StagedSequence& s : stage.sequences) {
    const InSequence& q = *std::ranges::find_if(m.seqs, [&](const InSequence& x) { return x.id == s.sequence; });
    const std::uint64_t need = (s.state->kv_length + std::uint64_t(page_size) - 1) / std::uint64_t(page_size);
    if (q.received != need) {
      return data_loss(fmt::format("{}: sequence {} of {} tokens needs {} pages, {} arrived", what, q.id.value(),
                                   s.state->kv_length, need, q.received));
    }
    if (s.state->version != version) {
      return failed_precondition(fmt::format("{}: sequence {} is of version {}, this worker holds version {}", what,
                                             q.id.value(), s.state->version.value(), version.value()));
    }
    if (cache->length(q.id).ok()) {
      return already_exists(fmt::format("{}: sequence {} is already live here", what, q.id.value()));
    }
  }
  return ok_status();
}

void KvMigrator::Impl::commit(InMigration& m, Incoming& msg, MigrationStage& stage) {
  MigrationEvent e;
  e.kind = MigrationEvent::Kind::kArrived;
  e.id = m.id;
  e.outgoing = false;
  e.state = MigrationState::kDone;
  for (InSequence& q : m.seqs) {
    auto s = std::ranges::find_if(stage.sequences,
                                  [&](const internal::StagedSequence& x) { return x.sequence == q.id; });
    // check_final made sure the id is free and the pages are reserved and enough.
    const Status adopted = cache->adopt_sequence(q.id, q.pages, std::int64_t(s->state->kv_length));
    LAMINAR_CHECK_MSG(adopted.ok(), adopted.to_string());
    q.pages.clear();
    e.sequences.push_back(q.id);
    e.states.push_back(std::move(*s->state));
  }
  m.ended = true;
  ++stats.done_in;
  record_finished(m.id, MigrationState::kDone, false);
  events.push_back(std::move(e));
  // Committed whether or not the answer reaches the source (see kv_migrator.h: the layer above
  // takes the first of two copies by trajectory id).
  (void)msg.from.reply(msg, Message{kStage, internal::encode_migration_stage_answer({std::nullopt, stage.stage})});
}

void KvMigrator::Impl::on_stage(Incoming& msg) {
  auto stage = internal::decode_migration_stage(msg.message.body);
  if (!stage.ok()) {
    // Which migration it was for is unknown; the source aborts on this answer and tells us.
    (void)msg.from.reply_error(msg, stage.status());
    if (device) drop_links_from(msg.from, stage.status());
    return;
  }
  auto it = in.find(stage->migration_id);
  if (it == in.end() || it->second.ended || it->second.ep.id() != msg.from.id()) {
    // A stage that crossed our abort on the way gets the abort's reason, whichever the source
    // reads first.
    auto gone = finished.find(stage->migration_id);
    const bool aborted_here = gone != finished.end() && !gone->second.outgoing && !gone->second.reason.ok();
    (void)msg.from.reply(msg, refusal_answer(aborted_here ? gone->second.reason
                                                          : not_found(fmt::format(
                                                                "kv migrator: no migration {:#x} from this source is "
                                                                "running here",
                                                                stage->migration_id))));
    // Its transfers come all the same, on a link this side cannot tell.
    if (device) drop_links_from(msg.from, not_found("kv migrator: a stage of a migration not running here"));
    return;
  }
  InMigration& m = it->second;
  if (Status why = check_stage(m, *stage); !why.ok()) return refuse(m, msg, why);
  if (device) {
    // Counted as they arrive: the next stage may come before this one's pages are in.
    for (const internal::StagedSequence& s : stage->sequences) {
      std::ranges::find_if(m.seqs, [&](const InSequence& x) { return x.id == s.sequence; })->received +=
          std::uint32_t(s.checksums.size());
    }
    ++m.next_stage;
    m.deadline = deadline_after(*clock, options.lease);
    auto l = links.find(m.link);
    if (l == links.end() || stage->batch < l->second.next_batch || l->second.waiting.contains(stage->batch)) {
      return refuse(m, msg,
                    invalid_argument(fmt::format("kv migrator: stage {} of migration {:#x}: batch {} on NCCL link "
                                                 "{:#x}, out of its order",
                                                 stage->stage, stage->migration_id, stage->batch, m.link)));
    }
    const std::uint64_t batch = stage->batch;
    l->second.waiting.emplace(batch, std::pair{m.id.value(), Receiving{std::move(msg), std::move(*stage), nullptr}});
    return post_receives(l->first, l->second);
  }
  std::uint64_t failures = 0;
  SequenceId first_bad;
  std::uint32_t first_bad_page = 0;
  for (const internal::StagedSequence& s : stage->sequences) {
    const InSequence& q = *std::ranges::find_if(m.seqs, [&](const InSequence& x) { return x.id == s.sequence; });
    for (std::size_t i = 0; i < s.checksums.size(); ++i) {
      if (page_checksum(q.pages[s.first_page + i]) == s.checksums[i]) continue;
      if (failures++ == 0) {
        first_bad = q.id;
        first_bad_page = s.first_page + std::uint32_t(i);
      }
    }
    stats.pages_received += s.checksums.size();
  }
  if (failures == 0) {
    for (const internal::StagedSequence& s : stage->sequences) {
      std::ranges::find_if(m.seqs, [&](const InSequence& x) { return x.id == s.sequence; })->received +=
          std::uint32_t(s.checksums.size());
    }
    ++m.next_stage;
  }
  stage_checked(m, msg, *stage, failures, first_bad, first_bad_page);
}

void KvMigrator::Impl::refuse(InMigration& m, Incoming& msg, const Status& why) {
  (void)msg.from.reply(msg, refusal_answer(why));
  end_in(m, MigrationState::kAbortedByDestination, why, false, true);
}

void KvMigrator::Impl::drop_links_from(const Endpoint& from, const Status& why) {
  std::vector<std::uint64_t> ids;
  for (const auto& [id, l] : links) {
    if (l.rank == 1 && l.ep.id() == from.id()) ids.push_back(id);
  }
  for (std::uint64_t id : ids) drop_link(id, why);
}

void KvMigrator::Impl::stage_checked(InMigration& m, Incoming& msg, MigrationStage& stage, std::uint64_t failures,
                                     SequenceId first_bad, std::uint32_t first_bad_page) {
  if (failures > 0) {
    stats.checksum_failures += failures;
    return refuse(m, msg,
                  data_loss(fmt::format("kv migrator: stage {} of migration {:#x}: {} pages failed their checksum, "
                                        "the first page {} of sequence {}",
                                        stage.stage, stage.migration_id, failures, first_bad_page, first_bad.value())));
  }
  m.deadline = deadline_after(*clock, options.lease);
  if (stage.final) {
    if (Status why = check_final(m, stage); !why.ok()) return refuse(m, msg, why);
    return commit(m, msg, stage);
  }
  (void)msg.from.reply(msg, Message{kStage, internal::encode_migration_stage_answer({std::nullopt, stage.stage})});
}

Result<std::uint64_t> KvMigrator::Impl::receive_link(const Endpoint& from) {
  for (const auto& [id, l] : links) {
    if (l.rank == 1 && l.ep.id() == from.id()) return id;
  }
  auto token = internal::KvDeviceLink::new_token();
  LAMINAR_RETURN_IF_ERROR(token.status().with_context("kv migrator: making an NCCL link"));
  auto joined = internal::KvDeviceLink::join(*token, 1, cache->device());
  LAMINAR_RETURN_IF_ERROR(joined.status().with_context("kv migrator: making an NCCL link"));
  std::uint64_t id = 0;
  while (id == 0 || links.contains(id)) id = rng();
  Link l;
  l.link = std::move(*joined);
  l.ep = from;
  l.rank = 1;
  l.token = std::move(*token);
  l.join_deadline = deadline_after(*clock, options.stall_timeout);
  links.emplace(id, std::move(l));
  watch(from);
  return id;
}

void KvMigrator::Impl::post_receives(std::uint64_t link_id, Link& l) {
  if (!l.joined) return;
  while (!l.waiting.empty() && l.waiting.begin()->first == l.next_batch) {
    auto node = l.waiting.extract(l.waiting.begin());
    auto& [migration, rec] = node.mapped();
    auto it = in.find(migration);
    if (it == in.end() || it->second.ended) {
      // end_in drops the link of a migration with stages waiting; this is only a safeguard.
      return drop_link(link_id, internal_error(fmt::format("kv migrator: NCCL link {:#x}: batch {} of an ended "
                                                           "migration",
                                                           link_id, node.key())));
    }
    InMigration& m = it->second;
    std::vector<const InSequence*> seqs;
    std::vector<std::int32_t> pages;
    for (const internal::StagedSequence& s : rec.stage.sequences) {
      seqs.push_back(&*std::ranges::find_if(m.seqs, [&](const InSequence& x) { return x.id == s.sequence; }));
      const auto first = seqs.back()->pages.begin() + s.first_page;
      pages.insert(pages.end(), first, first + std::ptrdiff_t(s.checksums.size()));
    }
    const auto spans = device_spans(rec.stage, [&](std::size_t k, std::uint32_t i) {
      return seqs[k]->pages[rec.stage.sequences[k].first_page + i];
    });
    auto work = l.link->post(spans, device_pools, pages);
    if (!work.ok()) {
      return drop_link(link_id, work.status().with_context(fmt::format("kv migrator: migration {:#x}: receiving "
                                                                       "stage {}",
                                                                       migration, rec.stage.stage)));
    }
    rec.work = std::move(*work);
    m.receiving.push_back(std::move(rec));
    ++l.next_batch;
  }
}

void KvMigrator::Impl::check_received(InMigration& m) {
  while (!m.ended && !m.receiving.empty()) {
    auto done = m.receiving.front().work->done();
    if (!done.ok()) {
      return drop_link(m.link, done.status().with_context(fmt::format("kv migrator: migration {:#x}: receiving "
                                                                      "stage {}",
                                                                      m.id.value(),
                                                                      m.receiving.front().stage.stage)));
    }
    if (!*done) return;
    Receiving rec = std::move(m.receiving.front());
    m.receiving.pop_front();
    const std::vector<std::uint64_t>& sums = rec.work->checksums();
    std::uint64_t failures = 0;
    SequenceId first_bad;
    std::uint32_t first_bad_page = 0;
    std::size_t j = 0;
    for (const internal::StagedSequence& s : rec.stage.sequences) {
      for (std::size_t i = 0; i < s.checksums.size(); ++i, ++j) {
        if (sums[j] == s.checksums[i]) continue;
        if (failures++ == 0) {
          first_bad = s.sequence;
          first_bad_page = s.first_page + std::uint32_t(i);
        }
      }
      stats.pages_received += s.checksums.size();
    }
    stage_checked(m, rec.msg, rec.stage, failures, first_bad, first_bad_page);
  }
}

void KvMigrator::Impl::on_abort_for_destination(const MigrationAbort& a, const Endpoint& from) {
  // The source's confirmation that none of its puts is in flight any more.
  release_fenced([&](std::uint64_t id, const Fenced& f) { return id == a.migration_id && f.ep.id() == from.id(); });
  auto it = in.find(a.migration_id);
  if (it == in.end() || it->second.ended || it->second.ep.id() != from.id()) return;
  end_in(it->second, MigrationState::kAbortedBySource,
         Status(a.code, fmt::format("kv migrator: migration {:#x}: the source aborted: {}", a.migration_id, a.reason)),
         false, false);
}

void KvMigrator::Impl::expire_leases() {
  const Duration now = clock->now();
  release_fenced([&](std::uint64_t, const Fenced& f) { return now >= f.until; });
  for (auto& [id, m] : in) {
    if (m.ended || now < m.deadline) continue;
    ++stats.lease_expiries;
    end_in(m, MigrationState::kAbortedByDestination,
           deadline_exceeded(fmt::format("kv migrator: migration {:#x}: the source was silent for the whole lease "
                                         "of {} ms",
                                         id,
                                         std::chrono::duration_cast<std::chrono::milliseconds>(options.lease).count())),
           true, true);
  }
}

void KvMigrator::Impl::end_in(InMigration& m, MigrationState state, Status reason, bool tell, bool fence) {
  m.ended = true;
  if (device) {
    // The link goes with it: both sides drop theirs when a migration on it ends short, so they
    // never wait on each other's transfers again. NCCL writes only into receives posted here, and
    // aborting the link ends those: no late write can land in the pages, none is fenced.
    drop_link(m.link, reason);
    m.receiving.clear();
    fence = false;
  }
  if (tell) {
    send_abort(m.ep, MigrationAbort{m.id.value(), MigrationSide::kDestination, reason.code(), reason.message()},
               internal::kMigrationAbortSendTimeout);
  }
  ++stats.aborted_in;
  MigrationEvent e;
  e.kind = MigrationEvent::Kind::kAborted;
  e.id = m.id;
  e.outgoing = false;
  e.state = state;
  for (const InSequence& q : m.seqs) e.sequences.push_back(q.id);
  e.reason = reason;
  record_finished(m.id, state, false, std::move(reason));
  std::vector<std::int32_t> pages;
  for (InSequence& q : m.seqs) {
    pages.insert(pages.end(), q.pages.begin(), q.pages.end());
    q.pages.clear();
  }
  if (fence) {
    fenced.emplace(m.id.value(), Fenced{m.ep, std::move(pages), deadline_after(*clock, options.lease), std::move(e)});
    return;
  }
  LAMINAR_CHECK(cache->unreserve_pages(pages).ok());
  events.push_back(std::move(e));
}

}  // namespace laminar
