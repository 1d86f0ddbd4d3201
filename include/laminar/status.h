// status.h: Status, StatusCode and Result<T>, the error model of every public laminar call.
//
// Nothing throws across laminar's public API. A call that can fail returns a Status (or a
// Result<T> holding either a value or a non-ok Status). The code says what the caller should
// do next; the message names the thing that was wrong and its value.
//
//   laminar::Result<laminar::WeightManifest> m = laminar::WeightManifest::from_json(text);
//   if (!m.ok()) {
//     std::cerr << m.status().to_string() << "\n";  // "INVALID_ARGUMENT: tensor 'w': ..."
//     return;
//   }
//   std::cout << m->total_bytes();
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace laminar {

// Chosen by what the caller does next (the same split as abseil's canonical codes).
//
// Capacity. A limit that lifts by itself as work drains (credits in flight, migrations running at
// once, a queue waiting for its reader) is kUnavailable: retry the same call later, nothing is
// wrong. kResourceExhausted is kept for KV pages, batch slots and memory: retrying the same call
// does not help until the caller frees some or asks for less.
enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,     // fix the input
  kNotFound,            // the named thing does not exist; fix the name
  kAlreadyExists,       // the thing being created is there already
  kFailedPrecondition,  // fix the state first (e.g. publish before acquire)
  kOutOfRange,          // asked past the end of something valid
  kResourceExhausted,   // out of KV pages, batch slots or memory
  kUnavailable,         // retry the same call (peer gone, or transient capacity: see above)
  kAborted,             // redo the whole operation (e.g. the version moved during a pull)
  kDeadlineExceeded,    // too slow
  kCancelled,           // the caller, or shutdown, stopped it
  kDataLoss,            // data failed its checksum or is truncated
  kUnimplemented,       // not compiled in / not supported in this build
  kInternal,            // a bug of ours
};

// "INVALID_ARGUMENT" etc.
std::string_view status_code_name(StatusCode code) noexcept;

class [[nodiscard]] Status {
 public:
  Status() noexcept = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() noexcept { return Status(); }

  bool ok() const noexcept { return code_ == StatusCode::kOk; }
  StatusCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  // "OK" or "CODE: message".
  std::string to_string() const;

  // Prepends context ("while pulling version 7: ...") keeping the code.
  Status with_context(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() noexcept { return Status(); }
inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status already_exists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status failed_precondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status resource_exhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status deadline_exceeded(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status data_loss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

namespace internal {
[[noreturn]] void check_failed(const char* file, int line, const char* expr, std::string_view msg);
}  // namespace internal

// Result<T>: a value, or the non-ok Status explaining why there is none.
template <class T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::remove_cv_t<T>, Status>, "Result<Status> is meaningless");

 public:
  // Implicit from a value and from a Status so `return value;` and `return status;` both read well.
  Result(const T& value) : v_(value) {}  // NOLINT(google-explicit-constructor)
  Result(T&& value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) {
      internal::check_failed(__FILE__, __LINE__, "!status.ok()",
                             "Result<T> built from an OK Status carries no value");
    }
  }
  template <class U>
    requires(std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, T> &&
             !std::is_same_v<std::decay_t<U>, Status> && !std::is_same_v<std::decay_t<U>, Result>)
  Result(U&& value) : v_(std::in_place_index<0>, std::forward<U>(value)) {}  // NOLINT

  bool ok() const noexcept { return v_.index() == 0; }
  // OK when a value is held.
  Status status() const { return ok() ? Status() : std::get<1>(v_); }

  // Preconditions: ok(). Calling these on an error is a bug and aborts with the error.
  T& value() & { return checked(); }
  const T& value() const& { return const_cast<Result*>(this)->checked(); }
  T&& value() && { return std::move(checked()); }
  T& operator*() & { return checked(); }
  const T& operator*() const& { return const_cast<Result*>(this)->checked(); }
  T* operator->() { return &checked(); }
  const T* operator->() const { return &const_cast<Result*>(this)->checked(); }

  template <class U>
  T value_or(U&& fallback) const& {
    return ok() ? std::get<0>(v_) : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  T& checked() {
    if (!ok()) {
      internal::check_failed(__FILE__, __LINE__, "result.ok()", std::get<1>(v_).to_string());
    }
    return std::get<0>(v_);
  }

  std::variant<T, Status> v_;
};

}  // namespace laminar

// Aborts with file and line when an invariant of laminar itself is broken. Never used on what a
// caller passed in: that gets a Status.
#define LAMINAR_CHECK(cond)                                                   \
  do {                                                                        \
    if (!(cond)) ::laminar::internal::check_failed(__FILE__, __LINE__, #cond, ""); \
  } while (0)

#define LAMINAR_CHECK_MSG(cond, msg)                                             \
  do {                                                                           \
    if (!(cond)) ::laminar::internal::check_failed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define LAMINAR_RETURN_IF_ERROR(expr)                   \
  do {                                                  \
    ::laminar::Status laminar_status_ = (expr);         \
    if (!laminar_status_.ok()) return laminar_status_;  \
  } while (0)
