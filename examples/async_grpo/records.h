// records.h: what each process of the asynchronous GRPO run records, and how it travels to the
// launcher, which turns it into the report (report.h).
//
// Every process (actor, relays, rollout workers) appends its records, one JSON object a line, to a
// file of its own through a RecordWriter; the launcher reads each file back with read_records, which
// validates every field and names the file and line of anything wrong (a worker killed mid-write
// leaves a truncated last line: an error, never a crash). Times are steady_clock nanoseconds
// (CLOCK_MONOTONIC on Linux, one clock for every process of a host); the report measures them from
// the launcher's start of each schedule.
//
//   auto w = async_grpo::RecordWriter::open(dir / "rollout-1.jsonl").value();
//   Status st = w.write(async_grpo::Span{.process = "rollout-1", .worker = 1,
//                                        .kind = async_grpo::SpanKind::kDecode,
//                                        .start_ns = t0, .end_ns = t1, .version = 3, .tokens = 512});
//   laminar::Result<async_grpo::Records> r = async_grpo::read_record_dir(dir);  // every process's file
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "laminar/status.h"

namespace async_grpo {

// What a process was doing over a span of time.
enum class SpanKind : std::uint8_t {
  kDecode,      // a rollout worker generating tokens
  kPrefill,     // a rollout worker filling the KV cache of new prompts
  kPull,        // fetching a weight version (WeightPuller)
  kMigrateOut,  // sending sequences' KV blocks to another worker (KvMigrator)
  kMigrateIn,   // receiving them
  kTrain,       // the actor's optimiser step
  kPublish,     // the actor handing a version to its RelayStore
  kIdleWait,    // blocked: no prompts, no batch, or waiting for weights
};
inline constexpr int kNumSpanKinds = 8;

// "decode", "prefill", "pull", "migrate_out", "migrate_in", "train", "publish", "idle-wait".
std::string_view span_kind_name(SpanKind kind) noexcept;
laminar::Result<SpanKind> parse_span_kind(std::string_view name);

struct Span {
  std::string process;      // e.g. "actor", "rollout-2": letters, digits, '_', '-', '.'
  std::uint32_t worker = 0;  // worker (thread or engine) within the process
  SpanKind kind = SpanKind::kDecode;
  std::int64_t start_ns = 0;  // steady_clock
  std::int64_t end_ns = 0;    // >= start_ns
  std::uint64_t version = 0;    // policy version decoded with, pulled, trained or published
  std::uint64_t sequences = 0;  // sequences decoded, trained or migrated
  std::uint64_t bytes = 0;      // bytes pulled or migrated
  std::uint64_t tokens = 0;     // tokens decoded or trained
  friend bool operator==(const Span&, const Span&) = default;
};

// The mean reward of the samples trained at one version.
struct RewardPoint {
  std::int64_t time_ns = 0;
  std::uint64_t version = 0;
  double mean_reward = 0;  // finite
  std::uint64_t samples = 0;  // > 0
  friend bool operator==(const RewardPoint&, const RewardPoint&) = default;
};

// One trajectory the actor trained on.
struct TrajectoryFact {
  std::uint64_t behaviour_version = 0;  // the version that generated it
  std::uint64_t trained_version = 0;    // the actor's version when it trained on it; >= behaviour
  std::uint64_t length = 0;             // response tokens, > 0
  std::uint64_t group = 0;              // its GRPO group: the prompt index the dispatcher dealt
  friend bool operator==(const TrajectoryFact&, const TrajectoryFact&) = default;
};

// One repack: RepackPolicy's order carried out by KvMigrator.
struct RepackEvent {
  std::int64_t time_ns = 0;
  std::uint64_t moved_sequences = 0;
  std::uint64_t bytes = 0;
  friend bool operator==(const RepackEvent&, const RepackEvent&) = default;
};

// One rollout worker taking up a new version: from the version's publication to its weights in use.
struct WeightSync {
  std::string process;
  std::uint64_t version = 0;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;  // >= start_ns
  friend bool operator==(const WeightSync&, const WeightSync&) = default;
};

using Record = std::variant<Span, RewardPoint, TrajectoryFact, RepackEvent, WeightSync>;

// Everything recorded during one schedule's run, from every process.
struct Records {
  std::vector<Span> spans;
  std::vector<RewardPoint> rewards;
  std::vector<TrajectoryFact> trajectories;
  std::vector<RepackEvent> repacks;
  std::vector<WeightSync> syncs;

  void add(Record record);
  // Appends every record of `other` (another process's file).
  void append(Records other);
  friend bool operator==(const Records&, const Records&) = default;
};

// Process and schedule names end up in file names, gnuplot scripts and trace JSON, so they are
// 1 to 64 letters, digits, '_', '-' or '.'. kInvalidArgument naming `what` otherwise.
laminar::Status check_name(std::string_view what, std::string_view name);

// kInvalidArgument naming the field when a record breaks the rules in the comments above.
laminar::Status validate_record(const Record& record);

// One line of JSON, without the newline. Fails as validate_record does.
laminar::Result<std::string> encode_record(const Record& record);
// Inverse of encode_record; kInvalidArgument naming what is wrong (not JSON, unknown type or field,
// a field missing, of the wrong type or out of range).
laminar::Result<Record> decode_record(std::string_view line);

// Every line of `text` (records separated by '\n'; the last line must end with one too).
// `source` names the text in errors: "<source> line <n>: ...". kDataLoss for a truncated last line,
// kInvalidArgument for a bad record.
laminar::Result<Records> parse_records(std::string_view text, std::string_view source);
// parse_records of the file's contents; kNotFound when it cannot be read.
laminar::Result<Records> read_records(const std::filesystem::path& path);
// The actor's waits for samples (its kIdleWait spans), by when each ended, with their total and
// the start of the first (0 when there are none): the report and the run's simulator both measure
// the training loop from that start.
struct ActorWaits {
  std::map<std::int64_t, std::int64_t> by_end_ns;  // end -> duration
  std::int64_t total_ns = 0;
  std::int64_t first_start_ns = 0;
};
ActorWaits actor_waits(const Records& records);

// Every "*.jsonl" file directly in `dir` (one per process), read in name order and appended.
// kNotFound when `dir` is not a directory; the first bad file's error otherwise.
laminar::Result<Records> read_record_dir(const std::filesystem::path& dir);

// Appends records to one file, a line each, flushed after each line so a killed process loses at
// most the line it was writing. Thread-safe.
class RecordWriter {
 public:
  // Creates or truncates `path`. kUnavailable when it cannot be opened.
  static laminar::Result<RecordWriter> open(const std::filesystem::path& path);

  RecordWriter(RecordWriter&&) noexcept = default;
  RecordWriter& operator=(RecordWriter&&) noexcept = default;

  // kInvalidArgument for an invalid record (nothing written); kUnavailable when writing fails.
  laminar::Status write(const Record& record);

 private:
  struct FileCloser {
    void operator()(std::FILE* f) const noexcept { std::fclose(f); }
  };
  RecordWriter(std::unique_ptr<std::FILE, FileCloser> file, std::filesystem::path path)
      : file_(std::move(file)), path_(std::move(path)), mu_(std::make_unique<std::mutex>()) {}

  std::unique_ptr<std::FILE, FileCloser> file_;
  std::filesystem::path path_;
  std::unique_ptr<std::mutex> mu_;  // behind a pointer so the writer stays movable
};

}  // namespace async_grpo
