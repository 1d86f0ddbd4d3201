// Checks shared by the kernels' Params::from_tensors: each view against the others (shape, dtype,
// density, device), with messages that name the kernel, the tensor and the mismatch.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

// Assigns the value of the Result `expr` to `lhs`, or returns its Status from the enclosing function.
#define LAMINAR_ASSIGN_OR_RETURN(lhs, expr)            \
  do {                                                 \
    auto laminar_result_ = (expr);                     \
    if (!laminar_result_.ok()) return laminar_result_.status(); \
    lhs = std::move(laminar_result_).value();   \
  } while (0)

namespace laminar::kernels::tensor_args {

// "[4, 32, 128]"
inline std::string shape_string(std::span<const std::int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

inline Status mismatch(const char* kernel, const char* name, const std::string& what) {
  return invalid_argument(fmt::format("{}: {}: {}", kernel, name, what));
}

inline Status expect_ndim(const char* kernel, const char* name, const TensorView& v, int ndim, const char* layout) {
  if (v.ndim() == ndim) return ok_status();
  return mismatch(kernel, name, fmt::format("shape {} but {} is needed", shape_string(v.shape()), layout));
}

inline Status expect_dtype(const char* kernel, const char* name, const TensorView& v, DType dtype) {
  if (v.dtype() == dtype) return ok_status();
  return mismatch(kernel, name, fmt::format("dtype {} but {} is needed", dtype_name(v.dtype()), dtype_name(dtype)));
}

// Same shape and dtype as `other`.
inline Status expect_like(const char* kernel, const char* name, const TensorView& v, const char* other_name,
                          const TensorView& other) {
  if (!std::equal(v.shape().begin(), v.shape().end(), other.shape().begin(), other.shape().end())) {
    return mismatch(kernel, name,
                    fmt::format("shape {} but {} has {}", shape_string(v.shape()), other_name,
                                shape_string(other.shape())));
  }
  if (v.dtype() != other.dtype()) {
    return mismatch(kernel, name,
                    fmt::format("dtype {} but {} is {}", dtype_name(v.dtype()), other_name, dtype_name(other.dtype())));
  }
  return ok_status();
}

// dim(i) == value, where value is what `source` says that dimension must be.
inline Status expect_dim(const char* kernel, const char* name, const TensorView& v, int i, std::int64_t value,
                         const std::string& source) {
  if (v.dim(i) == value) return ok_status();
  return mismatch(kernel, name,
                  fmt::format("shape {} but {} gives dim {} = {}", shape_string(v.shape()), source, i, value));
}

// The kernels index these tensors as dense row-major arrays.
inline Status expect_dense(const char* kernel, const char* name, const TensorView& v) {
  if (v.is_contiguous()) return ok_status();
  return mismatch(kernel, name,
                  fmt::format("strides [{}] of shape {} are not dense row-major", fmt::join(v.strides(), ", "),
                              shape_string(v.shape())));
}

// A 1-D dense [n] tensor of `dtype`.
inline Status expect_vector(const char* kernel, const char* name, const TensorView& v, std::int64_t n,
                            const std::string& source, DType dtype) {
  LAMINAR_RETURN_IF_ERROR(expect_ndim(kernel, name, v, 1, fmt::format("[{}]", n).c_str()));
  LAMINAR_RETURN_IF_ERROR(expect_dim(kernel, name, v, 0, n, source));
  LAMINAR_RETURN_IF_ERROR(expect_dtype(kernel, name, v, dtype));
  return expect_dense(kernel, name, v);
}

// Where every tensor of one call lives: all on the host (pageable or page-locked), or all on one
// CUDA device. Fed the tensors one by one; the first fixes the placement.
class Placement {
 public:
  explicit Placement(const char* kernel) : kernel_(kernel) {}

  Status add(const char* name, const TensorView& v) {
    const Device d = v.device();
    if (first_ == nullptr) {
      first_ = name;
      device_ = d;
      return ok_status();
    }
    const bool same = d.is_host() ? device_.is_host() : (!device_.is_host() && d.id == device_.id);
    if (same) return ok_status();
    return mismatch(kernel_, name,
                    fmt::format("on {} but {} is on {} (all tensors on the host, or all on one CUDA device)",
                                to_string(d), first_, to_string(device_)));
  }
  Status add(const char* name, const std::optional<TensorView>& v) { return v ? add(name, *v) : ok_status(); }

  bool on_device() const noexcept { return first_ != nullptr && !device_.is_host(); }

 private:
  const char* kernel_;
  const char* first_ = nullptr;
  Device device_ = Device::cpu();
};

// The int32 array an index tensor holds: its own data when it is i32; on the host, an i64 tensor is
// copied into *storage with every value checked to fit int32. On a CUDA device the kernels read the
// indices in place, so i64 there is refused (convert on the device, e.g. tensor.to(torch.int32)).
inline Result<const std::int32_t*> int32_indices(const char* kernel, const char* name, const TensorView& v,
                                                 bool on_device, std::vector<std::int32_t>* storage) {
  if (v.dtype() == DType::kI32) return v.data_as<const std::int32_t>();
  if (v.dtype() != DType::kI64) {
    return mismatch(kernel, name,
                    fmt::format("dtype {} but i32 (or i64 on the host) is needed", dtype_name(v.dtype())));
  }
  if (on_device) {
    return mismatch(kernel, name,
                    "i64 on a CUDA device: the kernel reads i32 indices in place there; convert them on the device");
  }
  if (storage == nullptr) {
    return mismatch(kernel, name, "i64 indices need a buffer for their i32 copy, and none was given");
  }
  const std::int64_t n = v.numel();
  const auto* src = v.data_as<const std::int64_t>();
  storage->resize(std::size_t(n));
  for (std::int64_t i = 0; i < n; ++i) {
    if (src[i] < std::numeric_limits<std::int32_t>::min() || src[i] > std::numeric_limits<std::int32_t>::max()) {
      return mismatch(kernel, name, fmt::format("[{}] = {} does not fit int32", i, src[i]));
    }
    (*storage)[std::size_t(i)] = std::int32_t(src[i]);
  }
  return static_cast<const std::int32_t*>(storage->data());
}

}  // namespace laminar::kernels::tensor_args
