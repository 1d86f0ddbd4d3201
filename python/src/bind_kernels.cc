// Kernels on tensors given through DLPack (torch tensors, NumPy arrays; read and written in place):
// cast, token sampling, the selected-token log-prob and paged decode attention. Host tensors run on
// the calling thread with the GIL released. CUDA tensors run on the call's `stream` when given,
// else on torch's current stream of the tensor's device for a torch tensor, else on the legacy
// default stream; every CUDA tensor is exported through DLPack for that same stream.
#include <dlpack/dlpack.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "laminar/kernels/cast.h"
#include "laminar/kernels/paged_decode.h"
#include "laminar/kernels/sampling.h"

namespace laminar::python {
namespace {

// The CUDA device of a tensor, or nullopt for anything else (DlpackTensor::borrow then names what
// is wrong with an object that is no tensor).
std::optional<int> cuda_device(py::handle obj) {
  if (!py::hasattr(obj, "__dlpack_device__")) return std::nullopt;
  try {
    auto device = obj.attr("__dlpack_device__")().cast<std::pair<int, int>>();
    if (device.first == kDLCUDA) return device.second;
  } catch (py::error_already_set&) {
  } catch (py::cast_error&) {
  }
  return std::nullopt;
}

// torch's current stream on `device` for a torch tensor; 0 (the legacy default) for other producers.
// torch is looked up, never imported: a torch tensor means it is loaded.
std::uintptr_t torch_current_stream(py::handle obj, int device) {
  py::dict modules = py::module_::import("sys").attr("modules");
  if (!modules.contains("torch")) return 0;
  py::object torch = modules["torch"];
  if (!py::isinstance(obj, torch.attr("Tensor"))) return 0;
  return torch.attr("cuda").attr("current_stream")(device).attr("cuda_stream").cast<std::uintptr_t>();
}

// The stream of one call, chosen from its first tensor, and the tensors it borrows for that
// stream; they stay alive as long as this holder. An absent (None) one is nullopt.
class Borrowed {
 public:
  Borrowed(py::handle first, std::string_view what, py::handle stream) {
    std::optional<std::uintptr_t> given;
    if (!stream.is_none()) given = to_uint(stream, "stream", std::numeric_limits<std::uintptr_t>::max());
    std::optional<int> device = cuda_device(first);
    if (!device) {
      if (given) throw_invalid("stream applies to CUDA tensors only, and " + std::string(what) + " is not one");
      return;
    }
    cuda_stream_ = given ? *given : torch_current_stream(first, *device);
    stream_ = Stream::cuda(reinterpret_cast<void*>(cuda_stream_));
  }

  Stream stream() const { return stream_; }

  TensorView take(py::handle obj, std::string_view what) {
    keep_.push_back(DlpackTensor::borrow(obj, what, cuda_stream_));
    return keep_.back().view();
  }
  std::optional<TensorView> take_optional(py::handle obj, std::string_view what) {
    if (obj.is_none()) return std::nullopt;
    return take(obj, what);
  }

 private:
  Stream stream_ = Stream::host();
  std::uintptr_t cuda_stream_ = 0;
  std::vector<DlpackTensor> keep_;
};

std::int32_t threads(py::handle v) {
  return static_cast<std::int32_t>(to_uint(v, "cpu_threads", std::numeric_limits<std::int32_t>::max()));
}

template <class Params>
void run_released(const Params& p, Stream stream) {
  Status st;
  {
    py::gil_scoped_release unlocked;
    st = kernels::run(p, stream);
  }
  check(st);
}

}  // namespace

void bind_kernels(py::module_& m) {
  m.def(
      "cast",
      [](py::handle src, py::handle dst, py::handle stream) {
        Borrowed b(src, "src", stream);
        TensorView s = b.take(src, "src");
        TensorView d = b.take(dst, "dst");
        run_released(unwrap(kernels::CastParams::from_tensors(s, d)), b.stream());
      },
      py::arg("src"), py::arg("dst"), py::kw_only(), py::arg("stream") = py::none(), R"doc(
Converts src into dst, element by element, between float32, float16 and bfloat16 (round to nearest
even, NaN kept; the same bits on the CPU and CUDA). Both are tensors given through DLPack (torch
tensors, NumPy arrays) of the same shape, dense, on the host or one CUDA device; dst is written in
place, nothing is copied on the way in. On CUDA the cast is enqueued on a stream (see below).
InvalidArgumentError names the tensor and what is wrong (dtype, shape, strides, overlap).
stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a negative
or non-int stream, and for any stream with host tensors.
CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
device or driver takes the launch (retrying cannot help).)doc");

  m.def(
      "sample",
      [](py::handle logits, py::handle seed, py::handle position, py::handle token, py::handle temperature,
         py::handle top_k, py::handle top_p, py::handle min_p, py::handle raw_logprob,
         py::handle processed_logprob, py::handle kept_mass, py::handle cpu_threads, py::handle stream) {
        Borrowed b(logits, "logits", stream);
        kernels::SamplingTensors t;
        t.logits = b.take(logits, "logits");
        t.seed = b.take(seed, "seed");
        t.position = b.take(position, "position");
        t.token = b.take(token, "token");
        t.temperature = b.take_optional(temperature, "temperature");
        t.top_k = b.take_optional(top_k, "top_k");
        t.top_p = b.take_optional(top_p, "top_p");
        t.min_p = b.take_optional(min_p, "min_p");
        t.raw_logprob = b.take_optional(raw_logprob, "raw_logprob");
        t.processed_logprob = b.take_optional(processed_logprob, "processed_logprob");
        t.kept_mass = b.take_optional(kept_mass, "kept_mass");
        kernels::SamplingParams p = unwrap(kernels::SamplingParams::from_tensors(t));
        p.cpu_threads = threads(cpu_threads);
        run_released(p, b.stream());
      },
      py::arg("logits"), py::arg("seed"), py::arg("position"), py::arg("token"), py::kw_only(),
      py::arg("temperature") = py::none(), py::arg("top_k") = py::none(), py::arg("top_p") = py::none(),
      py::arg("min_p") = py::none(), py::arg("raw_logprob") = py::none(),
      py::arg("processed_logprob") = py::none(), py::arg("kept_mass") = py::none(), py::arg("cpu_threads") = 0,
      py::arg("stream") = py::none(), R"doc(
Samples one token per row of logits [batch, vocab] (float32/16, bfloat16; rows may be strided) into
token [batch] int32, in place. seed and position are int64 [batch]: each row's randomness is Philox
keyed by (seed, position), so a row's token depends only on its own logits and settings, never on
its batch mates, the thread count or CPU vs CUDA. Optional per-row settings: temperature float32
(below 1e-5: greedy), top_k int32 (0: off), top_p and min_p float32. Optional outputs, float32
[batch]: raw_logprob (log-softmax of the raw logits at the token, the same bits token_logprob
gives), processed_logprob (under the distribution sampled from) and kept_mass. InvalidArgumentError
names the tensor or the row and field that is wrong, before any output is written.
stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a negative
or non-int stream, and for any stream with host tensors.
CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
device or driver takes the launch (retrying cannot help).)doc");

  m.def(
      "token_logprob",
      [](py::handle logits, py::handle token, py::handle logprob, py::handle cpu_threads, py::handle stream) {
        Borrowed b(logits, "logits", stream);
        kernels::TokenLogprobTensors t{b.take(logits, "logits"), b.take(token, "token"),
                                       b.take(logprob, "logprob")};
        std::vector<std::int32_t> token_copy;
        kernels::TokenLogprobParams p = unwrap(kernels::TokenLogprobParams::from_tensors(t, &token_copy));
        p.cpu_threads = threads(cpu_threads);
        run_released(p, b.stream());
      },
      py::arg("logits"), py::arg("token"), py::arg("logprob"), py::kw_only(), py::arg("cpu_threads") = 0,
      py::arg("stream") = py::none(), R"doc(
Writes log-softmax(logits[row])[token[row]] into logprob [batch] float32, in place: what the trainer
scores a rollout's tokens with, bit-identical to sample's raw_logprob for the same logits. token is
int32, or int64 on the host. InvalidArgumentError names the row whose token is outside [0, vocab).
stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a negative
or non-int stream, and for any stream with host tensors.
CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
device or driver takes the launch (retrying cannot help).)doc");

  m.def(
      "paged_decode",
      [](py::handle q, py::handle out, py::handle k_pages, py::handle v_pages, py::handle indptr,
         py::handle indices, py::handle last_page_len, py::handle lse, py::handle qo_indptr, py::handle sm_scale,
         py::handle workspace, py::handle max_kv_len, py::handle cpu_threads, py::handle stream) {
        Borrowed b(q, "q", stream);
        kernels::PagedDecodeTensors t;
        t.q = b.take(q, "q");
        t.out = b.take(out, "out");
        t.k_pages = b.take(k_pages, "k_pages");
        t.v_pages = b.take(v_pages, "v_pages");
        t.indptr = b.take(indptr, "indptr");
        t.indices = b.take(indices, "indices");
        t.last_page_len = b.take(last_page_len, "last_page_len");
        t.lse = b.take_optional(lse, "lse");
        t.qo_indptr = b.take_optional(qo_indptr, "qo_indptr");
        if (!sm_scale.is_none()) {
          if (!PyFloat_Check(sm_scale.ptr()) && !PyLong_Check(sm_scale.ptr())) {
            throw_invalid("sm_scale must be a float or None");
          }
          t.sm_scale = sm_scale.cast<float>();
        }
        t.workspace = b.take_optional(workspace, "workspace");
        if (!max_kv_len.is_none()) {
          t.max_kv_len = static_cast<std::int32_t>(
              to_uint(max_kv_len, "max_kv_len", std::numeric_limits<std::int32_t>::max()));
        }
        kernels::PagedDecodeIndexCopies copies;
        kernels::PagedDecodeParams p = unwrap(kernels::PagedDecodeParams::from_tensors(t, &copies));
        p.cpu_threads = threads(cpu_threads);
        run_released(p, b.stream());
      },
      py::arg("q"), py::arg("out"), py::arg("k_pages"), py::arg("v_pages"), py::arg("indptr"), py::arg("indices"),
      py::arg("last_page_len"), py::kw_only(), py::arg("lse") = py::none(), py::arg("qo_indptr") = py::none(),
      py::arg("sm_scale") = py::none(), py::arg("workspace") = py::none(), py::arg("max_kv_len") = py::none(),
      py::arg("cpu_threads") = 0, py::arg("stream") = py::none(), R"doc(
Paged attention over one layer's KV pages, writing out (and lse) in place.
q, out: [num_rows, num_qo_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, num_kv_heads,
head_dim] (float32/16, bfloat16, all the same; head_dim 64 or 128; num_qo_heads = num_kv_heads *
group, group 1, 2, 4 or 8: query head h reads KV head h // group). The page table as in FlashInfer:
sequence b's pages are indices[indptr[b]:indptr[b + 1]], its last page holding last_page_len[b]
tokens (int32; int64 on the host only, where it is copied to int32).
Decode: one row per sequence, at its last position. Prefill: qo_indptr [batch + 1] gives each
sequence's rows, its last positions in order, causal. lse: [num_rows, num_qo_heads] float32,
natural-log sum of exp of the scaled scores. sm_scale defaults to 1 / sqrt(head_dim). On the host
max_kv_len defaults to the longest sequence and no workspace is needed; CUDA tensors (the page
table then on the device too) need max_kv_len and a workspace tensor of at least the bytes the
InvalidArgumentError for a missing one names. InvalidArgumentError names the tensor and the
mismatch.
stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a negative
or non-int stream, and for any stream with host tensors.
CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
device or driver takes the launch (retrying cannot help).)doc");
}

}  // namespace laminar::python
