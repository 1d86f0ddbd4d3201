// libFuzzer target for the remote trajectory queue's decoders (src/remote_trajectory_queue_wire.h):
// the push and push_many messages a server reads from producers, and the hello and push_many
// answers a producer reads from the server. Each input goes to all four. Built with clang
// (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as the CTest test
// remote_queue_decode_fuzz; seeds in remote_queue_decode_corpus/.
//
// Properties: decoding never crashes, leaks or trips a sanitizer, whatever the bytes; a refusal
// is kDataLoss naming an offset, or kInvalidArgument where the message says so; anything that
// decodes re-encodes to exactly the same bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "laminar/status.h"
#include "remote_trajectory_queue_wire.h"

namespace {

using namespace laminar;
using namespace laminar::internal;

void check_refusal(const Status& st, bool invalid_argument_allowed) {
  LAMINAR_CHECK_MSG(st.code() == StatusCode::kDataLoss ||
                        (invalid_argument_allowed && st.code() == StatusCode::kInvalidArgument),
                    st.to_string());
  LAMINAR_CHECK_MSG(st.code() != StatusCode::kDataLoss || st.message().find(" at offset ") != std::string::npos,
                    st.message());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const std::string_view view(reinterpret_cast<const char*>(data), size);

  if (Result<std::uint32_t> credits = decode_queue_hello(bytes); credits.ok()) {
    const std::vector<std::byte> again = encode_queue_hello(*credits);
    LAMINAR_CHECK(std::ranges::equal(again, bytes));
  } else {
    check_refusal(credits.status(), false);
  }

  if (Result<QueuePush> push = decode_queue_push(bytes); push.ok()) {
    LAMINAR_CHECK(push->trajectories.size() == 1);
    std::string again;
    encode_queue_push(push->trajectories[0], push->wait, again);
    LAMINAR_CHECK(again == view);
  } else {
    check_refusal(push.status(), true);
  }

  if (Result<QueuePush> many = decode_queue_push_many(bytes); many.ok()) {
    std::string again(kQueuePushManyHeaderBytes, '\0');
    for (const Trajectory& t : many->trajectories) append_queue_push_many_item(t, again);
    write_queue_push_many_header(many->wait, std::uint32_t(many->trajectories.size()), again);
    LAMINAR_CHECK(again == view);
  } else {
    check_refusal(many.status(), true);
  }

  if (Result<std::vector<Status>> statuses = decode_queue_statuses(bytes); statuses.ok()) {
    LAMINAR_CHECK(encode_queue_statuses(*statuses) == view);
  } else {
    check_refusal(statuses.status(), false);
  }
  return 0;
}
