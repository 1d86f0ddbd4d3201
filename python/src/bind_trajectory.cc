// Trajectory, FinishReason, and the trajectory's validation and binary encoding.
#include <string>

#include "bindings.h"
#include "laminar/trajectory.h"

namespace laminar::python {
namespace {

// Each field's setter checks its Python value, so a Trajectory never holds a value of the wrong
// type or width; the checks that need several fields are validate_trajectory's, at push.
void set_prompt_tokens(Trajectory& t, py::handle v) { t.prompt_tokens = to_int32_vector(v, "prompt_tokens"); }
void set_response_tokens(Trajectory& t, py::handle v) {
  t.response_tokens = to_int32_vector(v, "response_tokens");
}
void set_logprobs(Trajectory& t, py::handle v) { t.logprobs = to_float_vector(v, "logprobs"); }
void set_rewards(Trajectory& t, py::handle v) { t.rewards = to_float_vector(v, "rewards"); }

std::string repr(const Trajectory& t) {
  return "Trajectory(id=" + std::to_string(t.id.value()) + ", version=" + std::to_string(t.version.value()) +
         ", group_id=" + std::to_string(t.group_id.value()) + ", sample_index=" + std::to_string(t.sample_index) + "/" +
         std::to_string(t.group_size) + ", prompt_tokens=" + std::to_string(t.prompt_tokens.size()) +
         ", response_tokens=" + std::to_string(t.response_tokens.size()) + ", rewards=" +
         std::to_string(t.rewards.size()) + ", finish_reason=" + std::string(finish_reason_name(t.finish_reason)) +
         ")";
}

}  // namespace

void bind_trajectory(py::module_& m) {
  py::enum_<FinishReason>(m, "FinishReason", "Why generation of a trajectory ended.")
      .value("STOP", FinishReason::kStop, "end-of-sequence or a stop string")
      .value("LENGTH", FinishReason::kLength, "hit the token limit")
      .value("ABORT", FinishReason::kAbort, "cancelled by the rollout side")
      .value("ERROR", FinishReason::kError, "the engine failed");

  py::class_<Trajectory>(m, "Trajectory", R"doc(
One finished rollout sample, as TrajectoryQueue.push takes it.

Token arrays take a list or tuple of ints, or a 1-D NumPy array or CPU torch tensor of an integer
dtype (values must fit int32); log-probs and rewards take numbers, or a floating dtype. A wrong
dtype, a shape that is not 1-D or a value that does not fit raises InvalidArgumentError. Arrays read
back as new NumPy arrays (int32 tokens, float32 log-probs and rewards).)doc")
      .def(py::init([](TrajectoryId id, PromptId prompt_id, GroupId group_id, py::handle group_size,
                       py::handle sample_index, Version version, py::handle prompt_tokens,
                       py::handle response_tokens, py::handle logprobs, py::handle rewards,
                       FinishReason finish_reason, py::handle generation_start_ns,
                       py::handle generation_end_ns, std::string metadata) {
             Trajectory t;
             t.id = id;
             t.prompt_id = prompt_id;
             t.group_id = group_id;
             t.group_size = static_cast<std::uint32_t>(to_uint(group_size, "group_size", UINT32_MAX));
             t.sample_index = static_cast<std::uint32_t>(to_uint(sample_index, "sample_index", UINT32_MAX));
             t.version = version;
             set_prompt_tokens(t, prompt_tokens);
             set_response_tokens(t, response_tokens);
             set_logprobs(t, logprobs);
             set_rewards(t, rewards);
             t.finish_reason = finish_reason;
             t.timings.generation_start_ns = to_int64(generation_start_ns, "generation_start_ns");
             t.timings.generation_end_ns = to_int64(generation_end_ns, "generation_end_ns");
             t.metadata = std::move(metadata);
             return t;
           }),
           py::kw_only(), py::arg("id") = TrajectoryId(0), py::arg("prompt_id") = PromptId(0),
           py::arg("group_id") = GroupId(0), py::arg("group_size") = 1, py::arg("sample_index") = 0,
           py::arg("version") = Version(0),
           py::arg("prompt_tokens") = py::tuple(), py::arg("response_tokens") = py::tuple(),
           py::arg("logprobs") = py::tuple(), py::arg("rewards") = py::tuple(),
           py::arg("finish_reason") = FinishReason::kStop, py::arg("generation_start_ns") = 0,
           py::arg("generation_end_ns") = 0, py::arg("metadata") = "")
      .def_readwrite("id", &Trajectory::id, "Unique id (int).")
      .def_readwrite("prompt_id", &Trajectory::prompt_id, "The prompt it answers (int).")
      .def_readwrite("group_id", &Trajectory::group_id, "GRPO group (int).")
      .def_property(
          "group_size", [](const Trajectory& t) { return t.group_size; },
          [](Trajectory& t, py::handle v) {
            t.group_size = static_cast<std::uint32_t>(to_uint(v, "group_size", UINT32_MAX));
          },
          "Samples in the group; 1: not grouped.")
      .def_property(
          "sample_index", [](const Trajectory& t) { return t.sample_index; },
          [](Trajectory& t, py::handle v) {
            t.sample_index = static_cast<std::uint32_t>(to_uint(v, "sample_index", UINT32_MAX));
          },
          "In [0, group_size), unique within the group.")
      .def_readwrite("version", &Trajectory::version, "Policy version that generated every response token.")
      .def_property(
          "prompt_tokens",
          [](const Trajectory& t) { return to_numpy<std::int32_t>(t.prompt_tokens); }, &set_prompt_tokens,
          "int32[num_prompt_tokens]")
      .def_property(
          "response_tokens",
          [](const Trajectory& t) { return to_numpy<std::int32_t>(t.response_tokens); }, &set_response_tokens,
          "int32[num_response_tokens]")
      .def_property(
          "logprobs", [](const Trajectory& t) { return to_numpy<float>(t.logprobs); }, &set_logprobs,
          "float32[num_response_tokens]: behaviour log-prob of each response token")
      .def_property(
          "rewards", [](const Trajectory& t) { return to_numpy<float>(t.rewards); }, &set_rewards,
          "float32[num_rewards >= 1]")
      .def_readwrite("finish_reason", &Trajectory::finish_reason)
      .def_property(
          "generation_start_ns", [](const Trajectory& t) { return t.timings.generation_start_ns; },
          [](Trajectory& t, py::handle v) { t.timings.generation_start_ns = to_int64(v, "generation_start_ns"); })
      .def_property(
          "generation_end_ns", [](const Trajectory& t) { return t.timings.generation_end_ns; },
          [](Trajectory& t, py::handle v) { t.timings.generation_end_ns = to_int64(v, "generation_end_ns"); })
      .def_readwrite("metadata", &Trajectory::metadata, "A JSON object, or empty.")
      .def_property_readonly("num_tokens", &Trajectory::num_tokens, "Prompt plus response tokens.")
      .def(
          "validate", [](const Trajectory& t, bool contents) { check(validate_trajectory(t, contents)); },
          py::arg("contents") = true,
          "Raises InvalidArgumentError for what push would refuse without looking at the queue.")
      .def(
          "encode",
          [](const Trajectory& t) {
            std::string out;
            encode_trajectory(t, out);
            return py::bytes(out);
          },
          "The binary encoding of the write-ahead log and remote producers.")
      .def_static(
          "decode",
          [](py::bytes data, bool contents) {
            std::string_view bytes = data;
            return unwrap(decode_trajectory(bytes, contents));
          },
          py::arg("data"), py::arg("contents") = true,
          "Inverse of encode; DataLossError for truncated or padded bytes, InvalidArgumentError for an "
          "invalid trajectory.")
      .def("__copy__", [](const Trajectory& t) { return t; })
      .def("__deepcopy__", [](const Trajectory& t, py::dict) { return t; }, py::arg("memo"))
      .def("__eq__", [](const Trajectory& a, const Trajectory& b) { return a == b; }, py::is_operator())
      .def("__repr__", &repr);
}

}  // namespace laminar::python
