#include "comms.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace jaxdist {
namespace {

std::atomic<int64_t> timeout_ms{300000};
std::atomic<int64_t> debug_delay_us{0};
std::atomic<int> poll_mode{0};

std::mutex registry_mutex;
std::map<int64_t, std::map<int, std::unique_ptr<Comm>>> registry;

}  // namespace

void SetTimeoutMs(int64_t ms) { timeout_ms = ms; }
int64_t TimeoutMs() { return timeout_ms; }
void SetDebugDelayUs(int64_t us) { debug_delay_us = us; }
int64_t DebugDelayUs() { return debug_delay_us; }
void SetPollMode(int mode) { poll_mode = mode; }

const char* OpName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kSendRecv: return "sendrecv";
  }
  return "unknown";
}

std::string Describe(const NcclApi& nccl, const Comm& comm, const char* op, ncclResult_t r, const std::string& extra) {
  std::string msg = std::string("jaxdist nccl ") + op + " on axis '" + comm.axis + "' (rank " +
                    std::to_string(comm.rank) + " of " + std::to_string(comm.nranks) + ", device " +
                    std::to_string(comm.device) + "): ";
  msg += extra.empty() ? nccl.GetErrorString(r) : extra;
  const char* last = comm.comm ? nccl.GetLastError(comm.comm) : nccl.GetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') msg += std::string(" (NCCL: ") + last + ")";
  return msg;
}

static std::mutex abort_mutex;  // the handler thread and the watchdog may abort at once

std::string Abort(const NcclApi& nccl, Comm& comm, const std::string& msg) {
  std::lock_guard<std::mutex> lock(abort_mutex);
  if (comm.aborted) return comm.failure;
  if (comm.comm != nullptr) nccl.CommAbort(comm.comm);
  comm.failure = msg;
  comm.aborted = true;
  return comm.failure;
}

static std::string AbortWith(const NcclApi& nccl, Comm& comm, std::string msg) {
  return Abort(nccl, comm, msg + "; the communicator was aborted");
}

std::string Poll(const NcclApi& nccl, Comm& comm, const char* op, ncclResult_t issued) {
  if (issued != ncclSuccess && issued != ncclInProgress) {
    return AbortWith(nccl, comm, Describe(nccl, comm, op, issued));
  }
  // A blocking communicator has finished its work when the call returns; only
  // a non-blocking one (or an in-progress answer) needs polling. A non-blocking
  // one is polled even after ncclSuccess: seed 003 is a lone ncclSend that
  // answered ncclSuccess before its kernel was enqueued.
  if (comm.blocking && issued == ncclSuccess) return "";
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(TimeoutMs());
  // Yield-spin for the first 500 us: a healthy enqueue finishes in tens of
  // microseconds, and sleep_for rounds up to the timer slack (~50 us). Then
  // sleep with back-off so a slow peer burns no CPU.
  auto nap = std::chrono::microseconds(20);
  for (;;) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r;
    {
      // The watchdog thread may abort (and NCCL free) the communicator at any time.
      std::lock_guard<std::mutex> lock(abort_mutex);
      if (comm.aborted) return comm.failure;
      r = nccl.CommGetAsyncError(comm.comm, &state);
    }
    if (r != ncclSuccess) return AbortWith(nccl, comm, Describe(nccl, comm, op, r));
    if (state == ncclSuccess) return "";
    if (state != ncclInProgress) return AbortWith(nccl, comm, Describe(nccl, comm, op, state));
    const auto now = Clock::now();
    if (now > deadline) {
      return AbortWith(nccl, comm,
                       Describe(nccl, comm, op, ncclInProgress,
                                "still in progress after the " + std::to_string(TimeoutMs()) +
                                    " ms deadline (set JAXDIST_NCCL_TIMEOUT_S to change it)"));
    }
    if (now - start < std::chrono::microseconds(500)) {
      if (poll_mode.load(std::memory_order_relaxed) == 0) sched_yield();  // mode 1: pure busy spin
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
}

std::string EnsureReady(const NcclApi& nccl, Comm& comm, const char* op) {
  if (comm.aborted) return comm.failure;
  if (comm.ready) return "";
  std::string err = Poll(nccl, comm, op, ncclInProgress);
  if (err.empty()) comm.ready = true;
  return err;
}

static std::string IssueUnrecorded(const NcclApi& nccl, Comm& comm, const OpDesc& op, cudaStream_t stream,
                                   bool grouped);

std::string Issue(const NcclApi& nccl, Comm& comm, const OpDesc& op, cudaStream_t stream, bool grouped) {
  const char* name = OpName(op.kind);
  std::string err = EnsureReady(nccl, comm, name);
  if (!err.empty()) return err;
  if (!grouped && (op.kind == OpKind::kSendRecv || !comm.blocking)) {
    // The ungrouped path exists only to measure what the group costs; seed 003 is exactly an
    // ungrouped point-to-point op on a non-blocking communicator, so it refuses both.
    return "jaxdist nccl: the ungrouped benchmark path takes collectives on blocking communicators only";
  }
  // The flight record: "started" is recorded on the stream before the op, "finished" after it.
  const bool record = RecorderEnabled();
  const uint64_t seq =
      record ? comm.recorder.Begin(op.kind, op.dtype, op.count, op.send_peer, op.recv_peer, stream) : 0;
  err = IssueUnrecorded(nccl, comm, op, stream, grouped);
  if (record && err.empty()) comm.recorder.End(seq, stream);
  return err;
}

static std::string IssueUnrecorded(const NcclApi& nccl, Comm& comm, const OpDesc& op, cudaStream_t stream,
                                   bool grouped) {
  const char* name = OpName(op.kind);
  if (!grouped) {
    ncclResult_t call = ncclSuccess;
    switch (op.kind) {
      case OpKind::kAllReduce:
        call = nccl.AllReduce(op.send, op.recv, op.count, op.dtype, op.redop, comm.comm, stream);
        break;
      case OpKind::kAllGather: call = nccl.AllGather(op.send, op.recv, op.count, op.dtype, comm.comm, stream); break;
      case OpKind::kReduceScatter:
        call = nccl.ReduceScatter(op.send, op.recv, op.count, op.dtype, op.redop, comm.comm, stream);
        break;
      case OpKind::kSendRecv: break;
    }
    return Poll(nccl, comm, name, call);
  }
  ncclResult_t r = nccl.GroupStart();
  if (r != ncclSuccess) return AbortWith(nccl, comm, Describe(nccl, comm, name, r));
  ncclResult_t call = ncclSuccess;
  auto track = [&call](ncclResult_t x) {
    if (call == ncclSuccess || call == ncclInProgress) call = x;
  };
  switch (op.kind) {
    case OpKind::kAllReduce:
      track(nccl.AllReduce(op.send, op.recv, op.count, op.dtype, op.redop, comm.comm, stream));
      break;
    case OpKind::kAllGather:
      track(nccl.AllGather(op.send, op.recv, op.count, op.dtype, comm.comm, stream));
      break;
    case OpKind::kReduceScatter:
      track(nccl.ReduceScatter(op.send, op.recv, op.count, op.dtype, op.redop, comm.comm, stream));
      break;
    case OpKind::kSendRecv:
      // Even a lone send or recv goes inside the group (seed 003).
      if (op.send_peer >= 0) track(nccl.Send(op.send, op.count, op.dtype, op.send_peer, comm.comm, stream));
      if (op.recv_peer >= 0) track(nccl.Recv(op.recv, op.count, op.dtype, op.recv_peer, comm.comm, stream));
      break;
  }
  // The group is always closed, also after a failed call, so NCCL's group state stays balanced.
  r = nccl.GroupEnd();
  if (call != ncclSuccess && call != ncclInProgress) return AbortWith(nccl, comm, Describe(nccl, comm, name, call));
  return Poll(nccl, comm, name, r);
}

Comm* FindComm(int64_t key, int device) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(key);
  if (it == registry.end()) return nullptr;
  auto jt = it->second.find(device);
  return jt == it->second.end() ? nullptr : jt->second.get();
}

Comm* AddComm(int64_t key, int device) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& slot = registry[key][device];
  slot = std::make_unique<Comm>();
  slot->device = device;
  return slot.get();
}

void ForEachComm(int64_t key, const std::function<void(Comm&)>& fn) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(key);
  if (it == registry.end()) return;
  for (auto& [device, comm] : it->second) fn(*comm);
}

void ForEachCommOfAllKeys(const std::function<void(int64_t key, Comm&)>& fn) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto& [key, comms] : registry)
    for (auto& [device, comm] : comms) fn(key, *comm);
}

void RemoveComms(int64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(key);
}

}  // namespace jaxdist
