// TrajectoryQueue, its options, BatchSpec and Batch (whose fields come out as NumPy arrays).
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "laminar/trajectory_queue.h"

namespace laminar::python {
namespace {

// An array of one value per trajectory.
template <class T, class F>
py::array_t<T> per_trajectory(const Batch& b, F field) {
  std::span<const Trajectory> ts = b.trajectories();
  py::array_t<T> out(static_cast<py::ssize_t>(ts.size()));
  T* o = out.mutable_data();
  for (const Trajectory& t : ts) *o++ = static_cast<T>(field(t));
  return out;
}

template <class T, class F>
py::array_t<T> per_info(const Batch& b, F field) {
  std::span<const TrajectoryInfo> is = b.info();
  py::array_t<T> out(static_cast<py::ssize_t>(is.size()));
  T* o = out.mutable_data();
  for (const TrajectoryInfo& i : is) *o++ = static_cast<T>(field(i));
  return out;
}

// Every trajectory's `field` (a vector) end to end.
template <class T, class F>
py::array_t<T> concatenated(const Batch& b, F field) {
  std::size_t total = 0;
  for (const Trajectory& t : b.trajectories()) total += field(t).size();
  py::array_t<T> out(static_cast<py::ssize_t>(total));
  T* o = out.mutable_data();
  for (const Trajectory& t : b.trajectories()) o = std::copy(field(t).begin(), field(t).end(), o);
  return out;
}

// int64[n + 1]: trajectory i's part of concatenated(b, field) is [offsets[i], offsets[i + 1]).
template <class F>
py::array_t<std::int64_t> offsets(const Batch& b, F field) {
  std::span<const Trajectory> ts = b.trajectories();
  py::array_t<std::int64_t> out(static_cast<py::ssize_t>(ts.size() + 1));
  std::int64_t* o = out.mutable_data();
  std::int64_t at = 0;
  *o++ = 0;
  for (const Trajectory& t : ts) *o++ = at += static_cast<std::int64_t>(field(t).size());
  return out;
}

const auto kPrompt = [](const Trajectory& t) -> const std::vector<std::int32_t>& { return t.prompt_tokens; };
const auto kResponse = [](const Trajectory& t) -> const std::vector<std::int32_t>& { return t.response_tokens; };
const auto kLogprobs = [](const Trajectory& t) -> const std::vector<float>& { return t.logprobs; };
const auto kRewards = [](const Trajectory& t) -> const std::vector<float>& { return t.rewards; };

BatchId batch_id_of(py::handle batch_or_id) {
  if (py::isinstance<Batch>(batch_or_id)) return batch_or_id.cast<const Batch&>().id();
  if (!PyLong_Check(batch_or_id.ptr())) {
    throw_invalid("expected a Batch or a batch id (int), got " +
                  std::string(py::str(py::type::of(batch_or_id).attr("__name__"))));
  }
  return batch_or_id.cast<BatchId>();
}

}  // namespace

void bind_queue(py::module_& m) {
  py::enum_<StalenessRule>(m, "StalenessRule",
                           "staleness = consumer_version - trajectory.version (0 when the trajectory is newer).")
      .value("DROP", StalenessRule::kDrop, "drop units with staleness > max_staleness")
      .value("KEEP", StalenessRule::kKeep, "deliver everything; max_staleness is ignored")
      .value("KEEP_AND_MARK", StalenessRule::kKeepAndMark,
             "deliver everything; Batch.over_limit marks staleness > max_staleness");

  py::enum_<PartialGroupPolicy>(m, "PartialGroupPolicy",
                                "What happens to a GRPO group still incomplete when group_timeout runs out.")
      .value("RELEASE", PartialGroupPolicy::kRelease, "deliver the members present, marked partial_group")
      .value("DROP", PartialGroupPolicy::kDrop, "drop them");

  py::class_<TrajectoryQueueOptions> options_class(m, "TrajectoryQueueOptions", R"doc(
Options of a TrajectoryQueue; every field is also a keyword of the constructor. Durations are
seconds (float); None or math.inf means no timeout.)doc");
  def_kwargs_init(options_class);
  def_uint(options_class, "capacity_trajectories", &TrajectoryQueueOptions::capacity_trajectories,
           "Trajectories the queue holds at most (waiting in groups, ready and leased).");
  def_uint(options_class, "capacity_tokens", &TrajectoryQueueOptions::capacity_tokens, "Tokens it holds at most.");
  def_seconds(options_class, "default_lease", &TrajectoryQueueOptions::default_lease,
              "Lease of a popped batch whose BatchSpec.lease is 0.");
  def_seconds(options_class, "group_timeout", &TrajectoryQueueOptions::group_timeout,
              "How long a group may wait for its last member (None: forever).");
  options_class.def_readwrite("clock", &TrajectoryQueueOptions::clock,
                              "The Clock of leases, group timeouts and waits (None: Clock.steady()).");
  options_class.def_readwrite("partial_group_policy", &TrajectoryQueueOptions::partial_group_policy);
  options_class.def_readwrite("validate_contents", &TrajectoryQueueOptions::validate_contents,
                        "push() checks every token id, log-prob, reward and the metadata JSON.");
  options_class.def_readwrite("initial_version", &TrajectoryQueueOptions::initial_version,
                        "Newest published version at start.");
  def_uint(options_class, "id_dedup_window", &TrajectoryQueueOptions::id_dedup_window,
           "A retired trajectory id is refused for this many later retirements.");
  options_class.def_readwrite("wal_path", &TrajectoryQueueOptions::wal_path, "Write-ahead log file; empty: none.");
  options_class.def_readwrite("wal_fsync", &TrajectoryQueueOptions::wal_fsync, "fsync after every record.");
  def_uint(options_class, "wal_compact_bytes", &TrajectoryQueueOptions::wal_compact_bytes,
           "Compact the log once this large and at least half dead.");

  py::class_<BatchSpec> spec_class(m, "BatchSpec", R"doc(
What pop_batch takes; every field is also a keyword of the constructor. At least one of
max_trajectories and max_tokens is set. wait and lease are seconds (None or math.inf: forever).)doc");
  def_kwargs_init(spec_class);
  def_uint(spec_class, "max_trajectories", &BatchSpec::max_trajectories, "0: no count limit.");
  def_uint(spec_class, "max_tokens", &BatchSpec::max_tokens, "0: no token limit; prompt + response tokens.");
  def_uint(spec_class, "min_trajectories", &BatchSpec::min_trajectories, "Wait until this many are ready.");
  def_seconds(spec_class, "wait", &BatchSpec::wait, "How long to wait for min_trajectories (0: not at all).");
  spec_class.def_readwrite("consumer_version", &BatchSpec::consumer_version,
                     "The consumer's policy version; not ahead of the queue's newest.");
  spec_class.def_readwrite("staleness_rule", &BatchSpec::staleness_rule);
  def_uint(spec_class, "max_staleness", &BatchSpec::max_staleness, "Limit of staleness_rule.");
  def_seconds(spec_class, "lease", &BatchSpec::lease, "0: the queue's default_lease; None: never expires.");

  py::class_<Batch>(m, "Batch", R"doc(
A leased batch. Each field is a NumPy array with one entry per trajectory, or, for the token,
log-prob and reward arrays, every trajectory's values end to end with an int64 offsets array of
length len(batch) + 1: trajectory i's response tokens are
response_tokens[response_offsets[i]:response_offsets[i + 1]], and so are its logprobs. Each access
builds a new array. Reading stays valid after ack or expiry.)doc")
      .def_property_readonly("id", &Batch::id, "Batch id, for ack and nack.")
      .def("__len__", &Batch::size)
      .def_property_readonly("num_tokens", &Batch::num_tokens)
      .def_property_readonly(
          "lease_deadline", [](const Batch& b) { return from_duration(b.lease_deadline()); },
          "End of the lease, seconds on the queue's clock (math.inf: never).")
      .def(
          "__getitem__",
          [](const Batch& b, py::ssize_t i) {
            auto n = static_cast<py::ssize_t>(b.size());
            if (i < 0) i += n;
            if (i < 0 || i >= n) throw py::index_error("batch index out of range");
            return b.trajectories()[static_cast<std::size_t>(i)];
          },
          "A copy of trajectory i.")
      .def(
          "trajectories",
          [](const Batch& b) { return std::vector<Trajectory>(b.trajectories().begin(), b.trajectories().end()); },
          "Copies of every trajectory, as Trajectory objects.")
      .def_property_readonly("ids", [](const Batch& b) { return per_trajectory<std::uint64_t>(b, [](auto& t) { return t.id.value(); }); }, "uint64[n]")
      .def_property_readonly("prompt_ids", [](const Batch& b) { return per_trajectory<std::uint64_t>(b, [](auto& t) { return t.prompt_id.value(); }); }, "uint64[n]")
      .def_property_readonly("group_ids", [](const Batch& b) { return per_trajectory<std::uint64_t>(b, [](auto& t) { return t.group_id.value(); }); }, "uint64[n]")
      .def_property_readonly("group_sizes", [](const Batch& b) { return per_trajectory<std::uint32_t>(b, [](auto& t) { return t.group_size; }); }, "uint32[n]")
      .def_property_readonly("sample_indices", [](const Batch& b) { return per_trajectory<std::uint32_t>(b, [](auto& t) { return t.sample_index; }); }, "uint32[n]")
      .def_property_readonly("versions", [](const Batch& b) { return per_trajectory<std::uint64_t>(b, [](auto& t) { return t.version.value(); }); }, "uint64[n]")
      .def_property_readonly("finish_reasons", [](const Batch& b) { return per_trajectory<std::uint8_t>(b, [](auto& t) { return t.finish_reason; }); }, "uint8[n]: FinishReason values")
      .def_property_readonly("generation_start_ns", [](const Batch& b) { return per_trajectory<std::int64_t>(b, [](auto& t) { return t.timings.generation_start_ns; }); }, "int64[n]")
      .def_property_readonly("generation_end_ns", [](const Batch& b) { return per_trajectory<std::int64_t>(b, [](auto& t) { return t.timings.generation_end_ns; }); }, "int64[n]")
      .def_property_readonly("prompt_tokens", [](const Batch& b) { return concatenated<std::int32_t>(b, kPrompt); }, "int32[prompt_offsets[-1]]")
      .def_property_readonly("prompt_offsets", [](const Batch& b) { return offsets(b, kPrompt); }, "int64[n + 1]")
      .def_property_readonly("response_tokens", [](const Batch& b) { return concatenated<std::int32_t>(b, kResponse); }, "int32[response_offsets[-1]]")
      .def_property_readonly("response_offsets", [](const Batch& b) { return offsets(b, kResponse); }, "int64[n + 1], also the offsets of logprobs")
      .def_property_readonly("logprobs", [](const Batch& b) { return concatenated<float>(b, kLogprobs); }, "float32[response_offsets[-1]]")
      .def_property_readonly("rewards", [](const Batch& b) { return concatenated<float>(b, kRewards); }, "float32[reward_offsets[-1]]")
      .def_property_readonly("reward_offsets", [](const Batch& b) { return offsets(b, kRewards); }, "int64[n + 1]")
      .def_property_readonly(
          "metadata",
          [](const Batch& b) {
            std::vector<std::string> out;
            for (const Trajectory& t : b.trajectories()) out.push_back(t.metadata);
            return out;
          },
          "list[str]")
      .def_property_readonly("staleness", [](const Batch& b) { return per_info<std::uint64_t>(b, [](auto& i) { return i.staleness; }); }, "uint64[n]: consumer_version - version (0 if newer)")
      .def_property_readonly("over_limit", [](const Batch& b) { return per_info<bool>(b, [](auto& i) { return i.over_limit; }); }, "bool[n]: KEEP_AND_MARK and staleness > max_staleness")
      .def_property_readonly("partial_group", [](const Batch& b) { return per_info<bool>(b, [](auto& i) { return i.partial_group; }); }, "bool[n]: released by the group timeout with members missing")
      .def_property_readonly("delivery", [](const Batch& b) { return per_info<std::uint32_t>(b, [](auto& i) { return i.delivery; }); }, "uint32[n]: 1 on first delivery, +1 per redelivery");

  py::class_<TrajectoryQueue, std::shared_ptr<TrajectoryQueue>>(m, "TrajectoryQueue", R"doc(
The experience buffer between rollouts and the actor: bounded, version-tagged, releasing GRPO
groups whole, delivering exactly once (a popped batch is leased until ack). Every call is
thread-safe; the blocking ones (push, push_many, pop_batch) release the GIL while they wait, so
Python producer and consumer threads run at the same time.)doc")
      .def(py::init([](std::optional<TrajectoryQueueOptions> options) {
             return std::shared_ptr<TrajectoryQueue>(
                 unwrap(TrajectoryQueue::create(options.value_or(TrajectoryQueueOptions{}))));
           }),
           py::arg("options") = py::none(),
           "InvalidArgumentError for bad options; FailedPreconditionError or DataLossError for an unusable "
           "write-ahead log.")
      .def(
          "publish_version",
          [](TrajectoryQueue& q, Version v) {
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = q.publish_version(v);
            }
            check(st);
          },
          py::arg("version"), "Announces a published version; InvalidArgumentError if older than the newest.")
      .def("newest_version", &TrajectoryQueue::newest_version)
      .def(
          "push",
          &push_copy<TrajectoryQueue>,
          py::arg("trajectory"), py::kw_only(), py::arg("block") = true, py::arg("timeout") = py::none(),
          R"doc(
Pushes a copy of `trajectory` (which stays usable). When the queue is full: block=True waits
(up to `timeout` seconds if given, then DeadlineExceededError); block=False raises UnavailableError
at once (`timeout` is then ignored, as in queue.Queue.put). Raises InvalidArgumentError for an
invalid trajectory or a version ahead of newest_version(), AlreadyExistsError for an id the queue
holds or retired recently, FailedPreconditionError for a closed group, CancelledError after close().)doc")
      .def(
          "push_many",
          &push_many_copies<TrajectoryQueue>,
          py::arg("trajectories"), py::kw_only(), py::arg("block") = true, py::arg("timeout") = py::none(),
          "push for several trajectories at once; returns, per trajectory in order, None when it went in "
          "or the Error push would have raised (not raised).")
      .def(
          "pop_batch",
          [](TrajectoryQueue& q, const BatchSpec& spec) {
            std::optional<Result<Batch>> b;
            {
              py::gil_scoped_release unlocked;
              b.emplace(q.pop_batch(spec));
            }
            return unwrap(std::move(*b));
          },
          py::arg("spec"), R"doc(
Leases a batch. InvalidArgumentError for a spec without a limit, min_trajectories above
max_trajectories or a consumer_version ahead of newest_version(); UnavailableError when too few are
ready and spec.wait is 0; DeadlineExceededError when they did not become ready within spec.wait;
CancelledError after close().)doc")
      .def(
          "ack",
          [](TrajectoryQueue& q, py::handle batch) {
            BatchId id = batch_id_of(batch);
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = q.ack(id);
            }
            check(st);
          },
          py::arg("batch"),
          "Commits a batch (a Batch or its id). NotFoundError for an unknown or acked id; AbortedError when "
          "its lease ran out (do not apply it).")
      .def(
          "nack",
          [](TrajectoryQueue& q, py::handle batch) {
            BatchId id = batch_id_of(batch);
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = q.nack(id);
            }
            check(st);
          },
          py::arg("batch"), "Gives a batch back for redelivery ahead of everything else. Errors as ack.")
      .def(
          "close",
          [](TrajectoryQueue& q) {
            py::gil_scoped_release unlocked;
            q.close();
          },
          "Wakes every blocked push and pop with CancelledError and refuses later ones; acks still work.")
      .def(
          "stats",
          [](const TrajectoryQueue& q) {
            std::string json;
            {
              py::gil_scoped_release unlocked;
              json = q.stats().to_json();
            }
            return json_to_dict(json);
          },
          "Depth, flow, drops, staleness histogram, group waits and log, as a dict.")
      .def(
          "recovery", [](const TrajectoryQueue& q) { return json_to_dict(q.recovery().to_json()); },
          "What replaying the write-ahead log found, as a dict.")
      .def(
          "background_error", [](const TrajectoryQueue& q) { return status_to_exception(q.background_error()); },
          "The first error of work no caller waited on (an Error, not raised), or None.");
}

}  // namespace laminar::python
