// The launcher: warms the policy up, then for each schedule starts the actor, the relays and the
// rollout workers as children of this process (this binary again, with --role), watches them,
// stops and reaps every one, checks what the run must guarantee and writes the report.
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "blas.h"
#include "child_process.h"
#include "engine.h"
#include "held_out.h"
#include "pacing.h"
#include "predict.h"
#include "records.h"
#include "report.h"
#include "roles.h"
#include "task.h"
#include "trainer.h"

namespace async_grpo {

namespace fs = std::filesystem;
using laminar::Result;
using laminar::Status;
using namespace std::chrono_literals;

namespace {

using Child = examples::ChildProcess;

Result<std::string> wait_address(const fs::path& file, Child& child) {
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (path_exists(file)) {
      std::ifstream f(file);
      std::string address;
      std::getline(f, address);
      if (!address.empty()) return address;
    }
    if (child.exited()) return laminar::unavailable(fmt::format("{} exited with {}", child.name(), child.wait()));
    std::this_thread::sleep_for(20ms);
  }
  return laminar::deadline_exceeded(fmt::format("{} wrote no address in 120 s", child.name()));
}

// Reads each process's records; a killed worker's file may end in a torn line, which is dropped.
Result<async_grpo::Records> read_records_lenient(const fs::path& dir) {
  async_grpo::Records all;
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".jsonl") files.push_back(e.path());
  if (ec) return laminar::not_found(fmt::format("cannot read {}: {}", dir.string(), ec.message()));
  std::sort(files.begin(), files.end());
  for (const fs::path& p : files) {
    std::ifstream f(p, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    text.erase(text.find_last_of('\n') == std::string::npos ? 0 : text.find_last_of('\n') + 1);
    auto r = async_grpo::parse_records(text, p.string());
    if (!r.ok()) return r.status();
    all.append(std::move(*r));
  }
  return all;
}

struct CheckResult {
  std::string name;
  bool ok = false;
  std::string detail;
};

// Every version the actor kept (<dir>/versions/<v>.bin), evaluated on the held-out prompts at its
// publish time (the end of its publish span); each file is removed once evaluated.
Result<std::vector<async_grpo::HeldOutPoint>> evaluate_versions(const Settings& s, const std::string& schedule,
                                                                const fs::path& dir, const async_grpo::Records& records) {
  std::map<std::uint64_t, std::int64_t> published_at;
  for (const async_grpo::Span& span : records.spans)
    if (span.process == "actor" && span.kind == async_grpo::SpanKind::kPublish) published_at[span.version] = span.end_ns;
  std::map<std::uint64_t, fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir / "versions", ec)) {
    const std::string stem = e.path().stem().string();
    if (e.path().extension() != ".bin" || stem.empty() || stem.find_first_not_of("0123456789") != std::string::npos)
      continue;
    files[std::stoull(stem)] = e.path();
  }
  if (ec) return laminar::not_found(fmt::format("cannot read {}: {}", (dir / "versions").string(), ec.message()));
  auto task = make_task(s);
  if (!task.ok()) return task.status();
  std::vector<std::pair<std::uint64_t, fs::path>> todo(files.begin(), files.end());
  std::vector<async_grpo::HeldOutPoint> points;
  for (const auto& [version, file] : todo) {
    auto at = published_at.find(version);
    if (at == published_at.end())
      return laminar::internal_error(fmt::format("version {} was kept but has no publish record", version));
    points.push_back({.version = version, .time_ns = at->second});
  }
  const std::vector<async_grpo::DigitPrompt> prompts = task->held_out_prompts(std::size_t(s.eval_prompts));
  async_grpo::Progress progress(laminar::Clock::steady(), std::cout, async_grpo::Progress::mode_for_stdout());
  LAMINAR_RETURN_IF_ERROR(progress.begin(schedule + " held-out eval", std::max<std::size_t>(files.size(), 1), "versions"));
  // The schedule's processes have exited, so every core evaluates versions, one engine each.
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  std::size_t done = 0;
  laminar::Status failed;
  auto evaluate = [&] {
    auto fail = [&](laminar::Status st) {
      std::lock_guard lock(mu);
      if (failed.ok()) failed = std::move(st);
    };
    auto engine = async_grpo::Engine::create(async_grpo::PolicyConfig{});
    if (!engine.ok()) return fail(engine.status());
    std::vector<std::byte> flat(engine->manifest().total_bytes());
    for (std::size_t i; (i = next++) < todo.size();) {
      const fs::path& file = todo[i].second;
      std::ifstream f(file, std::ios::binary);
      f.read(reinterpret_cast<char*>(flat.data()), std::streamsize(flat.size()));
      if (!f) return fail(laminar::data_loss(fmt::format("{}: shorter than {} bytes", file.string(), flat.size())));
      if (laminar::Status st = engine->load_weights(flat); !st.ok()) return fail(st);
      // One seed for every version and schedule: the versions differ only in their weights.
      auto r = async_grpo::evaluate_held_out(*engine, *task, prompts, {.seed = s.seed * 1000003 + 12345});
      if (!r.ok()) return fail(r.status());
      points[i].reward = r->reward;
      std::error_code not_removed;
      fs::remove(file, not_removed);
      std::lock_guard lock(mu);
      if (!failed.ok()) return;
      if (laminar::Status st = progress.update(++done); !st.ok()) failed = st;
    }
  };
  std::vector<std::thread> helpers;
  for (unsigned t = 1; t < std::clamp(std::thread::hardware_concurrency(), 1u, 8u); ++t) helpers.emplace_back(evaluate);
  evaluate();
  for (std::thread& t : helpers) t.join();
  LAMINAR_RETURN_IF_ERROR(failed);
  LAMINAR_RETURN_IF_ERROR(progress.finish());
  return points;
}

struct ScheduleOutcome {
  async_grpo::ScheduleRun run;
  std::vector<CheckResult> checks;
  std::vector<std::string> notes;  // what the run could not check, and why
};

// The run's simulator on this run: the groups it dealt, with the lengths its samples came out, its
// workers, slots and pacing, and the actor's measured time per step (and of it, re-scoring before
// training), for as many steps as it trained.
Result<async_grpo::Prediction> predict_run(const Settings& s, const std::string& schedule,
                                           const async_grpo::Records& records) {
  auto task = make_task(s);
  if (!task.ok()) return task.status();
  auto pacing = async_grpo::Pacing::create(s.pacing);
  if (!pacing.ok()) return pacing.status();
  // The actor's time per step apart from waiting for samples: training, and re-scoring and
  // publishing around it, from its first wait to its last step's end.
  const async_grpo::ActorWaits waits = async_grpo::actor_waits(records);
  std::int64_t steps = 0, last_train = 0, scoring = 0;
  for (const async_grpo::Span& sp : records.spans) {
    if (sp.process != "actor" || sp.kind != async_grpo::SpanKind::kTrain) continue;
    ++steps;
    last_train = std::max(last_train, sp.end_ns);
    // From the batch's arrival (the end of the wait before the step) to the step's start.
    if (auto w = waits.by_end_ns.upper_bound(sp.start_ns); w != waits.by_end_ns.begin()) scoring += sp.start_ns - std::prev(w)->first;
  }
  if (steps == 0 || waits.by_end_ns.empty() || last_train <= waits.first_start_ns) {
    return laminar::failed_precondition("the actor trained no step");
  }
  std::map<std::uint64_t, std::vector<std::int64_t>> lengths;
  for (const async_grpo::TrajectoryFact& t : records.trajectories) lengths[t.group].push_back(std::int64_t(t.length));
  // Groups in dealing order, up to the first the records miss.
  std::vector<async_grpo::PredictGroup> groups;
  for (std::uint64_t g = 0; lengths.contains(g) && lengths[g].size() == std::size_t(s.group_size); ++g)
    groups.push_back({.prompt_tokens = std::int64_t(task->prompt(g).tokens.size()), .response_tokens = lengths[g]});
  async_grpo::PredictConfig c{.schedule = schedule,
                              .workers = s.workers,
                              .slots = s.max_live,
                              .group_size = s.group_size,
                              .groups_per_step = s.groups_per_step,
                              .max_staleness = s.max_staleness,
                              .in_flight_batches = s.in_flight_batches,
                              .train_step_s = double(last_train - waits.first_start_ns - waits.total_ns) / 1e9 / double(steps),
                              .steps = steps};
  c.score_s = std::min(c.train_step_s, double(scoring) / 1e9 / double(steps));
  return async_grpo::predict(c, *pacing, groups);
}

// Versions from which reward_rises compares held-out reward; with fewer, a rise is not checked.
constexpr std::size_t kHeldOutRiseVersions = 20;

Result<ScheduleOutcome> run_schedule(const Settings& s, const std::string& schedule, const fs::path& warm) {
  const fs::path dir = fs::absolute(fs::path(s.out) / schedule);
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir / "records", ec);
  if (!ec) fs::create_directories(dir / "versions", ec);
  if (ec) return laminar::unavailable("cannot create " + dir.string());
  ScheduleOutcome outcome;
  outcome.run.schedule = schedule;
  outcome.run.rollout_workers = std::uint32_t(s.workers);
  outcome.run.start_ns = now_ns();
  std::vector<std::string> common = settings_args(s);
  common.insert(common.end(), {"--dir", dir.string(), "--run-schedule", schedule});
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  std::vector<std::unique_ptr<Child>> children;
  auto actor = Child::spawn("actor", with({"--role", "actor", "--warm", warm.string()}));
  if (!actor.ok()) return actor.status();
  children.push_back(std::move(*actor));
  auto actor_address = wait_address(dir / "actor.addr", *children[0]);
  if (!actor_address.ok()) return actor_address.status();
  std::vector<std::string> relay_args;
  for (int r = 0; r < s.relays; ++r) {
    auto relay = Child::spawn(fmt::format("relay-{}", r), with({"--role", "relay", "--index", std::to_string(r),
                                                                "--actor", *actor_address}));
    if (!relay.ok()) return relay.status();
    children.push_back(std::move(*relay));
    auto address = wait_address(dir / fmt::format("relay-{}.addr", r), *children.back());
    if (!address.ok()) return address.status();
    relay_args.insert(relay_args.end(), {"--relay", *address});
  }
  const std::size_t first_rollout = children.size();
  for (int w = 0; w < s.workers; ++w) {
    std::vector<std::string> args = {"--role", "rollout", "--index", std::to_string(w), "--actor", *actor_address};
    args.insert(args.end(), relay_args.begin(), relay_args.end());
    auto rollout = Child::spawn(fmt::format("rollout-{}", w), with(args));
    if (!rollout.ok()) return rollout.status();
    children.push_back(std::move(*rollout));
  }

  async_grpo::Progress progress(laminar::Clock::steady(), std::cout, async_grpo::Progress::mode_for_stdout());
  // By steps, or by seconds under --minutes.
  const bool timed = s.minutes > 0;
  const std::uint64_t total = timed ? std::uint64_t(std::ceil(s.minutes * 60)) : std::uint64_t(s.steps);
  LAMINAR_RETURN_IF_ERROR(progress.begin(schedule, total, timed ? "s" : "steps"));
  const bool kill_one = s.kill_rollout_at > 0 && schedule == "laminar";
  bool killed = false;
  int actor_step = 0;
  std::vector<std::string> actor_lines;
  std::int64_t final_at = 0;  // when the actor's training ended
  bool stopped = false;
  while (children[0]->fd() >= 0) {
    // After training: rollout workers leave on their own, then the actor and relays are told to stop.
    if (!stopped && final_version(dir) > 0) {
      if (final_at == 0) final_at = now_ns();
      bool rollouts_left = true;
      for (std::size_t i = first_rollout; i < children.size(); ++i) rollouts_left = rollouts_left && children[i]->exited();
      if (!rollouts_left && now_ns() - final_at > std::int64_t(30e9)) {
        for (std::size_t i = first_rollout; i < children.size(); ++i)
          if (!children[i]->exited()) {
            std::cout << fmt::format("{} still running 30 s after training ended: SIGKILL\n", children[i]->name());
            children[i]->kill_now();
          }
        rollouts_left = true;
      }
      if (rollouts_left) {
        for (std::size_t i = 0; i < first_rollout; ++i) children[i]->terminate();
        stopped = true;
      }
    }
    std::vector<pollfd> fds;
    std::vector<Child*> who;
    for (auto& c : children)
      if (c->fd() >= 0) {
        fds.push_back({c->fd(), POLLIN, 0});
        who.push_back(c.get());
      }
    // Woken by the children's lines; once a second for the progress bar and the rollouts' deadline.
    if (poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR)
      return laminar::unavailable(fmt::format("poll: {}", std::strerror(errno)));
    if (timed)
      (void)progress.update(std::min<std::uint64_t>(std::uint64_t((now_ns() - outcome.run.start_ns) / 1'000'000'000), total));
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      std::vector<std::string> lines;
      who[i]->read_lines(lines);
      for (const std::string& line : lines) {
        // rollout-0 says when it starts samples: killed then, it dies holding them.
        if (kill_one && !killed && who[i] == children[first_rollout].get() && actor_step >= s.kill_rollout_at &&
            line.rfind("granted ", 0) == 0) {
          children[first_rollout]->kill_now();
          killed = true;
          std::cout << fmt::format("killed rollout-0 (pid {}) with SIGKILL after step {}, right after it was {}\n",
                                   children[first_rollout]->pid(), actor_step, line);
        }
        if (who[i] != children[0].get()) continue;
        actor_lines.push_back(line);
        if (std::sscanf(line.c_str(), "progress %d", &actor_step) == 1 && !timed)
          (void)progress.update(std::min<std::uint64_t>(std::uint64_t(actor_step), total));
      }
    }
  }
  const int actor_code = children[0]->wait();
  (void)progress.finish();
  outcome.run.end_ns = final_at > 0 ? final_at : now_ns();
  for (std::size_t i = 1; i < first_rollout; ++i) children[i]->terminate();
  const auto grace = std::chrono::steady_clock::now() + 15s;
  std::vector<int> codes(children.size(), 0);
  for (std::size_t i = 1; i < children.size(); ++i) {
    while (!children[i]->exited() && std::chrono::steady_clock::now() < grace) std::this_thread::sleep_for(20ms);
    if (!children[i]->exited()) {
      std::cout << fmt::format("{} still running after the stop: SIGKILL\n", children[i]->name());
      children[i]->kill_now();
    }
    codes[i] = children[i]->wait();
  }
  if (actor_code != 0) return laminar::internal_error(fmt::format("the actor exited with {}", actor_code));

  for (const std::string& line : actor_lines) {
    char name[64], verdict[16];
    int consumed = 0;
    if (std::sscanf(line.c_str(), "check %63s %15s %n", name, verdict, &consumed) >= 2)
      outcome.checks.push_back({name, std::string(verdict) == "ok", line.substr(std::size_t(consumed))});
    else if (line.rfind("dispatch ", 0) == 0 || line.rfind("repack ", 0) == 0)
      std::cout << schedule << " " << line << "\n";
    else if (line.rfind("blas ", 0) == 0)
      outcome.run.actor_blas = line.substr(5);
    else if (line.rfind("blas-warning ", 0) == 0)
      std::cout << schedule << " actor: " << line.substr(13) << "\n";
  }
  std::uint64_t reissued = 0, lost = 0;
  for (const std::string& line : actor_lines)
    if (line.rfind("dispatch ", 0) == 0) {
      auto field = [&](const std::string& key) -> std::uint64_t {
        const std::size_t at = line.find("\"" + key + "\":");
        return at == std::string::npos ? 0 : std::strtoull(line.c_str() + at + key.size() + 3, nullptr, 10);
      };
      reissued = field("reissued");
      lost = field("lost_workers");
    }
  bool exits_ok = true;
  std::string exits;
  for (std::size_t i = 1; i < children.size(); ++i) {
    const bool expected_kill = killed && i == first_rollout;
    exits_ok = exits_ok && (expected_kill ? codes[i] == 128 + SIGKILL : codes[i] == 0);
    exits += fmt::format("{}={} ", children[i]->name(), codes[i]);
  }
  outcome.checks.push_back({"exits", exits_ok, exits});
  if (kill_one)
    outcome.checks.push_back(
        {"killed_worker", killed && lost >= 1 && reissued >= 1,
         killed ? fmt::format("rollout-0 killed holding samples: {} lost worker(s), {} samples handed out again "
                              "(all_completed: none lost)",
                              lost, reissued)
                : "the run ended before the kill"});

  auto records = read_records_lenient(dir / "records");
  if (!records.ok()) return records.status();
  outcome.run.records = std::move(*records);
  if (auto predicted = predict_run(s, schedule, outcome.run.records); predicted.ok()) {
    outcome.run.predicted_samples_per_s = predicted->samples_per_s;
    outcome.run.predicted_waiting_share = predicted->actor_waiting_share;
  } else {
    outcome.notes.push_back("no prediction: " + predicted.status().to_string());
  }
  auto held_out = evaluate_versions(s, schedule, dir, outcome.run.records);
  if (!held_out.ok()) return held_out.status();
  outcome.run.held_out = std::move(*held_out);
  {
    const auto published = read_hashes(dir / "published.txt");
    const auto& h = outcome.run.held_out;
    const bool in_range =
        std::all_of(h.begin(), h.end(), [](const async_grpo::HeldOutPoint& p) { return p.reward >= 0 && p.reward <= 1; });
    std::string detail = fmt::format("{} of {} published versions evaluated on {} held-out prompts", h.size(),
                                     published.size(), s.eval_prompts);
    if (!h.empty()) detail += fmt::format(": version {} {:.3f}, version {} {:.3f}", h.front().version,
                                          h.front().reward, h.back().version, h.back().reward);
    outcome.checks.push_back({"held_out_eval", !h.empty() && h.size() == published.size() && in_range, detail});
  }
  const auto& h = outcome.run.held_out;
  const auto& rw = outcome.run.records.rewards;
  if (h.size() >= kHeldOutRiseVersions) {
    // Held-out reward scores every version on the same prompts and seed; a training step's reward
    // is one batch's and too noisy to compare two points of.
    double last = 0;
    for (std::size_t i = h.size() - 3; i < h.size(); ++i) last += h[i].reward / 3;
    outcome.checks.push_back({"reward_rises", last > h.front().reward,
                              fmt::format("held-out reward: version {} {:.3f}, mean of the last 3 versions {:.3f}",
                                          h.front().version, h.front().reward, last)});
  } else if (!rw.empty()) {
    // A stream trains first on the groups that finish first, the short and easy ones, so a training
    // step's reward is biased as well as noisy; and a few steps move held-out reward less than its
    // noise. (async_grpo_trainer_test checks that GRPO raises the reward.)
    const std::string held = h.empty() ? std::string("none")
                                       : fmt::format("version {} {:.3f}, version {} {:.3f}", h.front().version,
                                                     h.front().reward, h.back().version, h.back().reward);
    outcome.notes.push_back(fmt::format("reward rise not checked: {} versions, fewer than {}; held-out reward {}",
                                        h.size(), kHeldOutRiseVersions, held));
  }
  return outcome;
}


// One seed's schedules, one after the other, into s.out: their checks, the table and the report.
struct SeedOutcome {
  async_grpo::Comparison comparison;
  bool all_ok = true;
};

Result<SeedOutcome> run_seed(const Settings& s, const std::vector<std::string>& schedules,
                             const std::string& pacing_line) {
  std::error_code ec;
  fs::create_directories(s.out, ec);
  if (ec) return laminar::unavailable("cannot create " + s.out);
  const fs::path warm = fs::absolute(fs::path(s.out) / "warmup.bin");
  LAMINAR_RETURN_IF_ERROR(warm_up(s, warm).with_context("warm-up"));
  std::vector<async_grpo::ScheduleRun> runs;
  SeedOutcome out;
  for (const std::string& schedule : schedules) {
    Settings run = s;
    // Each contender trains for as long as the baseline took, not for as many steps: time to the
    // target is the comparison, and a schedule that steps faster must get to use that time.
    if (schedules.size() > 1 && s.minutes == 0 && !runs.empty()) {
      run.minutes = double(runs.front().end_ns - runs.front().start_ns) / 60e9;
      run.steps = 4 * s.steps;
    }
    auto outcome = run_schedule(run, schedule, warm);
    if (!outcome.ok()) return outcome.status().with_context(schedule);
    std::cout << fmt::format("{}: {:.1f} s wall\n", schedule,
                             double(outcome->run.end_ns - outcome->run.start_ns) / 1e9);
    for (const CheckResult& c : outcome->checks) {
      std::cout << fmt::format("  check {:<20} {}  {}\n", c.name, c.ok ? "ok  " : "FAIL", c.detail);
      out.all_ok = out.all_ok && c.ok;
    }
    for (const std::string& note : outcome->notes) std::cout << "  note  " << note << "\n";
    runs.push_back(std::move(outcome->run));
  }
  async_grpo::ReportOptions ro;
  ro.pacing = pacing_line;
  if (schedules.size() == 1) ro.baseline = ro.contender = schedules[0];
  auto files = async_grpo::write_report(runs, ro, s.out);
  if (!files.ok()) return files.status().with_context("report");
  std::cout << "\n" << files->table;
  if (!files->plot_note.empty()) std::cout << files->plot_note << "\n";
  std::cout << fmt::format("report in {}: table.txt, metrics.json, trace_<schedule>.json, plots\n", s.out);
  out.comparison = std::move(files->comparison);
  return out;
}

}  // namespace

Status warm_up(const Settings& s, const fs::path& file) {
  auto task = make_task(s);
  if (!task.ok()) return task.status();
  async_grpo::TrainerOptions to;
  to.seed = s.seed;
  to.intra_op_threads = 1;
  auto trainer = async_grpo::Trainer::create(to);
  if (!trainer.ok()) return trainer.status();
  if (s.warmup_steps > 0) {
    async_grpo::Progress progress(laminar::Clock::steady(), std::cout, async_grpo::Progress::mode_for_stdout());
    LAMINAR_RETURN_IF_ERROR(progress.begin("warm-up", std::uint64_t(s.warmup_steps), "steps"));
    // Prompts far past the ones the schedules deal, so RL sees prompts the warm-up did not.
    std::uint64_t next = async_grpo::kWarmupFirstPrompt;
    for (int i = 0; i < s.warmup_steps; ++i) {
      std::vector<async_grpo::DigitPrompt> prompts;
      for (int k = 0; k < s.warmup_batch; ++k) prompts.push_back(task->prompt(next++));
      auto st = (*trainer)->warmup_step(prompts);
      if (!st.ok()) return st.status();
      LAMINAR_RETURN_IF_ERROR(progress.update(std::uint64_t(i + 1)));
    }
    LAMINAR_RETURN_IF_ERROR(progress.finish());
  }
  std::vector<std::byte> flat((*trainer)->manifest().total_bytes());
  LAMINAR_RETURN_IF_ERROR((*trainer)->save_weights(flat));
  std::ofstream f(file, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(flat.data()), std::streamsize(flat.size()));
  return f ? laminar::ok_status() : laminar::unavailable("cannot write " + file.string());
}

int run_launcher(Settings s) {
  if (s.short_run) {
    s.workers = 3;
    s.steps = 10;
    s.warmup_steps = 20;
    s.groups_per_step = 4;
    s.group_size = 8;
    s.kill_rollout_at = 3;
    s.checkpoint_every = 4;
    if (s.schedule == "compare" || s.schedule == "all") s.schedule = "laminar";
  }
  if (s.device == "cuda" && s.repack && (s.schedule == "laminar" || s.schedule == "compare" || s.schedule == "all")) {
    std::fprintf(stderr, "async_grpo: --device cuda needs --repack false: the repack migrates host KV pools\n");
    return 2;
  }
  std::error_code ec;
  fs::create_directories(s.out, ec);
  if (ec) return fail("launcher", "out", laminar::unavailable("cannot create " + s.out));
  std::random_device rd;
  const std::string token = fmt::format("async-grpo-{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
  // The children inherit it, so it never shows on a command line.
  if (setenv("LAMINAR_TOKEN", token.c_str(), 1) != 0)
    return fail("launcher", "token", laminar::unavailable(fmt::format("setenv: {}", std::strerror(errno))));
  // The actors load the same library with the same environment; each says what it loaded.
  const async_grpo::BlasInfo blas = async_grpo::loaded_blas();
  std::cout << "BLAS: " << blas.describe() << "\n";
  if (!blas.warning().empty()) std::cout << blas.warning() << "\n";
  auto pacing = async_grpo::Pacing::create(s.pacing);
  if (!pacing.ok()) return fail("launcher", "pacing", pacing.status());
  // Described at the task's median: a prompt of n + 3 tokens, a context of 2n + 4 once answered.
  const auto median = std::int64_t(async_grpo::DigitTaskOptions{}.median_length);
  const std::string pacing_line = pacing->describe(s.max_live, 2 * median + 4, median + 3);
  std::cout << "rollout pacing: " << pacing_line << "\n";

  std::vector<std::string> schedules = {s.schedule};
  if (s.schedule == "compare") schedules = {"sync", "laminar"};
  if (s.schedule == "all") schedules = {"sync", "one-step", "areal", "laminar"};
  // Seed after seed, each running every schedule: a machine that slows down over the runs slows
  // every schedule alike.
  std::vector<std::uint64_t> seeds;
  std::vector<async_grpo::Comparison> comparisons;
  bool all_ok = true;
  for (int i = 0; i < s.seeds; ++i) {
    Settings seed = s;
    seed.seed = s.seed + std::uint64_t(i);
    if (s.seeds > 1) {
      seed.out = (fs::path(s.out) / fmt::format("seed-{}", seed.seed)).string();
      std::cout << fmt::format("\n== seed {} ({} of {}) ==\n", seed.seed, i + 1, s.seeds);
    }
    auto outcome = run_seed(seed, schedules, pacing->paced() ? pacing_line : "");
    if (!outcome.ok()) return fail("launcher", fmt::format("seed {}", seed.seed), outcome.status());
    all_ok = all_ok && outcome->all_ok;
    seeds.push_back(seed.seed);
    comparisons.push_back(std::move(outcome->comparison));
  }
  if (s.seeds > 1) {
    auto summary = async_grpo::summarize_seeds(seeds, comparisons);
    if (!summary.ok()) return fail("launcher", "seeds", summary.status());
    const std::string table = async_grpo::format_seed_table(*summary);
    std::ofstream(fs::path(s.out) / "seeds.txt") << table;
    std::ofstream(fs::path(s.out) / "seeds.json") << async_grpo::seed_summary_json(*summary);
    std::cout << "\n" << table << fmt::format("summary in {}: seeds.txt, seeds.json\n", s.out);
  }
  std::cout << (all_ok ? "all checks passed\n" : "some checks FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace async_grpo
