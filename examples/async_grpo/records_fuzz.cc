// libFuzzer target for async_grpo::parse_records, which reads the record files every process of the
// asynchronous GRPO example writes and its launcher reads back (examples/async_grpo/records.h); a
// process killed mid-write leaves whatever bytes it had written. Built with clang
// (-fsanitize=fuzzer,address,undefined) by this folder's CMakeLists.txt and run briefly as the CTest
// test async_grpo_records_fuzz; seeds in records_fuzz_corpus/.
//
// Properties: parsing never crashes, leaks or trips a sanitizer, whatever the bytes; a refusal is
// kDataLoss (a truncated last line) or kInvalidArgument (a bad record), naming the line; records that
// parse encode to lines that parse to the same records.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "records.h"

namespace {

template <class T>
void encode_all(const std::vector<T>& records, std::string& out) {
  for (const T& r : records) {
    laminar::Result<std::string> line = async_grpo::encode_record(r);
    LAMINAR_CHECK_MSG(line.ok(), line.status().to_string());
    out += *line;
    out += '\n';
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  laminar::Result<async_grpo::Records> r = async_grpo::parse_records(text, "fuzz.jsonl");
  if (!r.ok()) {
    const laminar::Status& st = r.status();
    LAMINAR_CHECK_MSG(st.code() == laminar::StatusCode::kDataLoss || st.code() == laminar::StatusCode::kInvalidArgument,
                      st.to_string());
    LAMINAR_CHECK_MSG(st.message().rfind("fuzz.jsonl line ", 0) == 0, st.message());
    return 0;
  }
  std::string again;
  encode_all(r->spans, again);
  encode_all(r->rewards, again);
  encode_all(r->trajectories, again);
  encode_all(r->repacks, again);
  encode_all(r->syncs, again);
  laminar::Result<async_grpo::Records> twice = async_grpo::parse_records(again, "re-encoded");
  LAMINAR_CHECK_MSG(twice.ok(), twice.status().to_string());
  LAMINAR_CHECK(*twice == *r);
  return 0;
}
