#include "flight_recorder.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace jaxdist {
namespace {

std::atomic<int64_t> current_step{-1};
std::atomic<bool> recorder_enabled{true};

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const char* StateName(const OpRecord& r) {
  if (!r.has_events) return "enqueued (no CUDA events)";
  switch (r.state) {
    case OpState::kEnqueued:
      return "enqueued";
    case OpState::kStarted:
      return "started";
    case OpState::kCompleted:
      return "completed";
  }
  return "unknown";
}

}  // namespace

void SetCurrentStep(int64_t step) { current_step.store(step, std::memory_order_relaxed); }
int64_t CurrentStep() { return current_step.load(std::memory_order_relaxed); }
void SetRecorderEnabled(bool on) { recorder_enabled = on; }
bool RecorderEnabled() { return recorder_enabled.load(std::memory_order_relaxed); }

size_t FlightRecorder::Capacity() {
  static const size_t n = [] {
    const char* s = getenv("JAXDIST_FLIGHT_RECORD_SIZE");
    long v = s ? std::strtol(s, nullptr, 10) : 0;
    return v > 0 ? static_cast<size_t>(v) : size_t{2048};
  }();
  return n;
}

uint64_t FlightRecorder::Begin(OpKind kind, ncclDataType_t dtype, size_t count, int send_peer, int recv_peer,
                               cudaStream_t stream) {
  const CudaApi* cuda = Cuda(nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  if (slots_.empty()) {
    // All events at the first op (a few ms once), so no later op pays for a cuEventCreate.
    slots_.resize(Capacity());
    for (OpRecord& r : slots_) {
      if (cuda == nullptr || cuda->EventCreate(&r.started, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS ||
          cuda->EventCreate(&r.finished, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
        break;  // no driver or no context: created lazily below, or never
    }
  }
  const uint64_t seq = next_seq_++;
  OpRecord& r = Slot(seq);
  r.seq = seq;
  r.kind = kind;
  r.dtype = dtype;
  r.count = count;
  r.send_peer = send_peer;
  r.recv_peer = recv_peer;
  r.step = CurrentStep();
  r.enqueued_ns = SteadyNs();
  r.enqueued_unix = UnixSeconds();
  r.state = OpState::kEnqueued;
  r.has_events = false;
  if (cuda != nullptr) {
    if (ctx_ == nullptr) cuda->CtxGetCurrent(&ctx_);
    CUstream s = reinterpret_cast<CUstream>(stream);
    bool ok = (r.started != nullptr || cuda->EventCreate(&r.started, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) &&
              (r.finished != nullptr || cuda->EventCreate(&r.finished, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS);
    r.has_events = ok && cuda->EventRecord(r.started, s) == CUDA_SUCCESS;
  }
  return seq;
}

void FlightRecorder::End(uint64_t seq, cudaStream_t stream) {
  const CudaApi* cuda = Cuda(nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  OpRecord& r = Slot(seq);
  if (r.seq != seq || !r.has_events || cuda == nullptr) return;
  r.has_events = cuda->EventRecord(r.finished, reinterpret_cast<CUstream>(stream)) == CUDA_SUCCESS;
}

void FlightRecorder::RefreshLocked() {
  const CudaApi* cuda = Cuda(nullptr);
  if (cuda == nullptr || slots_.empty()) return;
  if (ctx_ != nullptr) cuda->CtxSetCurrent(ctx_);  // event queries need the events' context current
  const uint64_t first = next_seq_ > slots_.size() ? next_seq_ - slots_.size() : 1;
  bool contiguous = true;
  for (uint64_t seq = std::max(first, completed_ + 1); seq < next_seq_; ++seq) {
    OpRecord& r = Slot(seq);
    if (r.has_events && r.state != OpState::kCompleted) {
      if (cuda->EventQuery(r.finished) == CUDA_SUCCESS) {
        r.state = OpState::kCompleted;
      } else if (r.state == OpState::kEnqueued && cuda->EventQuery(r.started) == CUDA_SUCCESS) {
        r.state = OpState::kStarted;
      }
    }
    // Only ops whose completion is known move the watermark; one without events stops it.
    contiguous = contiguous && r.has_events && r.state == OpState::kCompleted;
    if (contiguous) completed_ = seq;
  }
}

OpRecord FlightRecorder::OldestUnfinished() {
  std::lock_guard<std::mutex> lock(mu_);
  RefreshLocked();
  for (uint64_t seq = completed_ + 1; seq < next_seq_; ++seq) {
    const OpRecord& r = Slot(seq);
    if (r.seq == seq && r.has_events && r.state != OpState::kCompleted) return r;
  }
  return OpRecord{};
}

uint64_t FlightRecorder::LastEnqueued() {
  std::lock_guard<std::mutex> lock(mu_);
  return next_seq_ - 1;
}

uint64_t FlightRecorder::LastCompleted() {
  std::lock_guard<std::mutex> lock(mu_);
  RefreshLocked();
  return completed_;
}

std::string FlightRecorder::OpsJson() {
  std::lock_guard<std::mutex> lock(mu_);
  RefreshLocked();
  std::string out = "[";
  const uint64_t first = next_seq_ > slots_.size() ? next_seq_ - slots_.size() : 1;
  char buf[512];
  for (uint64_t seq = first; seq < next_seq_; ++seq) {
    const OpRecord& r = Slot(seq);
    std::snprintf(buf, sizeof(buf),
                  "%s{\"seq\": %llu, \"op\": \"%s\", \"dtype\": \"%s\", \"count\": %zu, \"send_peer\": %d, "
                  "\"recv_peer\": %d, \"step\": %lld, \"enqueued_unix\": %.6f, \"state\": \"%s\"}",
                  seq == first ? "" : ", ", static_cast<unsigned long long>(r.seq), OpName(r.kind),
                  DtypeName(r.dtype).c_str(), r.count, r.send_peer, r.recv_peer, static_cast<long long>(r.step),
                  r.enqueued_unix, StateName(r));
    out += buf;
  }
  return out + "]";
}

std::string DtypeName(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return "int8";
    case ncclUint8:
      return "uint8";
    case ncclInt32:
      return "int32";
    case ncclUint32:
      return "uint32";
    case ncclInt64:
      return "int64";
    case ncclUint64:
      return "uint64";
    case ncclFloat16:
      return "float16";
    case ncclFloat32:
      return "float32";
    case ncclFloat64:
      return "float64";
    case ncclBfloat16:
      return "bfloat16";
    default:
      return "dtype" + std::to_string(static_cast<int>(t));
  }
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\u%04x", c);
      out += esc;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace jaxdist
