#include "comms.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxdist {
namespace {

std::atomic<int64_t> timeout_ms{300000};
std::atomic<int64_t> debug_delay_us{0};
std::atomic<int> poll_mode{static_cast<int>(PollMode::kLocal)};
std::atomic<int64_t> poll_yields{0};
std::atomic<int64_t> poll_sleeps{0};

std::mutex registry_mutex;
std::map<int64_t, std::map<int, std::unique_ptr<Comm>>> registry;

}  // namespace

void SetTimeoutMs(int64_t ms) { timeout_ms = ms; }
int64_t TimeoutMs() { return timeout_ms; }
void SetDebugDelayUs(int64_t us) { debug_delay_us = us; }
int64_t DebugDelayUs() { return debug_delay_us; }
void SetPollMode(int mode) { poll_mode = mode; }
PollMode GetPollMode() { return static_cast<PollMode>(poll_mode.load(std::memory_order_relaxed)); }
PollCounts GetPollCounts() { return {poll_yields.load(), poll_sleeps.load()}; }
void ResetPollCounts() {
  poll_yields = 0;
  poll_sleeps = 0;
}

const char* OpName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kSendRecv:
      return "sendrecv";
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

std::string Abort(const NcclApi& nccl, Comm& comm, const std::string& msg) {
  // The handler thread and the watchdog may abort at once.
  std::lock_guard<std::mutex> lock(comm.mu);
  if (comm.aborted) return comm.failure;
  if (comm.comm != nullptr) nccl.CommAbort(comm.comm);
  comm.failure = msg;
  comm.aborted = true;
  return comm.failure;
}

static std::string AbortWith(const NcclApi& nccl, Comm& comm, std::string msg) {
  return Abort(nccl, comm, msg + "; the communicator was aborted");
}

static inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

std::string Poll(const NcclApi& nccl, Comm& comm, const char* op, ncclResult_t issued) {
  if (issued != ncclSuccess && issued != ncclInProgress) {
    return AbortWith(nccl, comm, Describe(nccl, comm, op, issued));
  }
  // A blocking communicator has finished its work when the call returns; only
  // a non-blocking one (or an in-progress answer) needs polling. A non-blocking
  // one is polled even after ncclSuccess: a lone ncclSend can answer
  // ncclSuccess before its kernel is enqueued (docs/design.md, the third failure).
  if (comm.blocking && issued == ncclSuccess) return "";
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(TimeoutMs());
  const PollMode mode = GetPollMode();
  // A non-blocking ncclGroupEnd hands the launch to a thread of NCCL's own, which
  // finishes in tens of microseconds when healthy. In the first 500 us the poller
  // busy-polls or yields (mode): sleep_for would round up to the timer slack
  // (~50 us), and busy-polling for long keeps NCCL's thread off a shared CPU. Then
  // it sleeps with back-off so a slow peer burns no CPU.
  auto nap = std::chrono::microseconds(20);
  for (int polls = 1;; ++polls) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r;
    {
      // The watchdog thread may abort (and NCCL free) the communicator at any time.
      std::lock_guard<std::mutex> lock(comm.mu);
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
    const auto waited = now - start;
    if (waited < std::chrono::microseconds(500)) {
      const bool spin = mode == PollMode::kSpin || (mode == PollMode::kLocal && polls <= kSpinPolls);
      if (spin) {
        CpuRelax();
      } else {
        poll_yields.fetch_add(1, std::memory_order_relaxed);
        sched_yield();
      }
    } else {
      poll_sleeps.fetch_add(1, std::memory_order_relaxed);
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

static std::string IssueUngrouped(const NcclApi& nccl, Comm& comm, const OpDesc& op, cudaStream_t stream);
static std::string IssueInOneGroup(const NcclApi& nccl, Comm& comm, const OpDesc* ops, size_t n, cudaStream_t stream);

namespace {
// Restricts the calling thread to the CPU it runs on for its lifetime, then
// restores its affinity. A thread created meanwhile (NCCL's group thread)
// inherits the one-CPU mask and keeps it. Does nothing where the masks cannot be read or set.
// NCCL 2.28 starts its long-lived threads (proxy service and progress, RAS, socket
// helpers) at init or from those threads, never from the group thread; only the
// group's short-lived connection jobs (first use of a peer or algorithm) inherit the mask.
class PinToThisCpu {
 public:
  PinToThisCpu() {
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof(saved_), &saved_) != 0) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pinned_ = sched_setaffinity(0, sizeof(one), &one) == 0;
  }
  ~PinToThisCpu() {
    if (pinned_) sched_setaffinity(0, sizeof(saved_), &saved_);
  }
  PinToThisCpu(const PinToThisCpu&) = delete;
  PinToThisCpu& operator=(const PinToThisCpu&) = delete;

 private:
  cpu_set_t saved_;
  bool pinned_ = false;
};

ncclResult_t GroupEnd(const NcclApi& nccl, const Comm& comm) {
  if (comm.blocking || GetPollMode() != PollMode::kLocal) return nccl.GroupEnd();
  PinToThisCpu pin;
  return nccl.GroupEnd();
}
}  // namespace

std::string Issue(const NcclApi& nccl, Comm& comm, const OpDesc& op, cudaStream_t stream, bool grouped) {
  if (!grouped) {
    const char* name = OpName(op.kind);
    std::string err = EnsureReady(nccl, comm, name);
    if (!err.empty()) return err;
    if (op.kind == OpKind::kSendRecv || !comm.blocking) {
      // The ungrouped path exists only to measure what the group costs; the corruption this protocol
      // prevents is exactly an ungrouped point-to-point op on a non-blocking communicator, so it refuses both.
      return "jaxdist nccl: the ungrouped benchmark path takes collectives on blocking communicators only";
    }
    const bool record = RecorderEnabled();
    const uint64_t seq =
        record ? comm.recorder.Begin(op.kind, op.dtype, op.count, op.send_peer, op.recv_peer, stream) : 0;
    err = IssueUngrouped(nccl, comm, op, stream);
    if (record && err.empty()) comm.recorder.End(seq, stream);
    return err;
  }
  return IssueGroup(nccl, comm, &op, 1, stream);
}

std::string IssueGroup(const NcclApi& nccl, Comm& comm, const OpDesc* ops, size_t n, cudaStream_t stream) {
  if (n == 0) return "jaxdist nccl: a group of no ops";
  const char* name = OpName(ops[0].kind);
  std::string err = EnsureReady(nccl, comm, name);
  if (!err.empty()) return err;
  // The flight record: each op's "started" is recorded on the stream before the group, its
  // "finished" after it (NCCL runs a group's ops as one launch).
  const bool record = RecorderEnabled();
  std::vector<uint64_t> seqs;
  if (record) {
    seqs.reserve(n);
    for (size_t i = 0; i < n; ++i)
      seqs.push_back(
          comm.recorder.Begin(ops[i].kind, ops[i].dtype, ops[i].count, ops[i].send_peer, ops[i].recv_peer, stream));
  }
  err = IssueInOneGroup(nccl, comm, ops, n, stream);
  if (record && err.empty())
    for (uint64_t seq : seqs) comm.recorder.End(seq, stream);
  return err;
}

static std::string IssueUngrouped(const NcclApi& nccl, Comm& comm, const OpDesc& op, cudaStream_t stream) {
  ncclResult_t call = ncclSuccess;
  switch (op.kind) {
    case OpKind::kAllReduce:
      call = nccl.AllReduce(op.send, op.recv, op.count, op.dtype, op.redop, comm.comm, stream);
      break;
    case OpKind::kAllGather:
      call = nccl.AllGather(op.send, op.recv, op.count, op.dtype, comm.comm, stream);
      break;
    case OpKind::kReduceScatter:
      call = nccl.ReduceScatter(op.send, op.recv, op.count, op.dtype, op.redop, comm.comm, stream);
      break;
    case OpKind::kSendRecv:
      break;
  }
  return Poll(nccl, comm, OpName(op.kind), call);
}

static std::string IssueInOneGroup(const NcclApi& nccl, Comm& comm, const OpDesc* ops, size_t n, cudaStream_t stream) {
  const char* name = OpName(ops[0].kind);
  ncclResult_t r = nccl.GroupStart();
  if (r != ncclSuccess) return AbortWith(nccl, comm, Describe(nccl, comm, name, r));
  ncclResult_t call = ncclSuccess;
  auto track = [&call](ncclResult_t x) {
    if (call == ncclSuccess || call == ncclInProgress) call = x;
  };
  // After a failed call the rest of the group is not issued: the communicator is aborted below.
  for (size_t i = 0; i < n && (call == ncclSuccess || call == ncclInProgress); ++i) {
    const OpDesc& op = ops[i];
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
        // Even a lone send or recv goes inside the group (docs/design.md, the third failure).
        if (op.send_peer >= 0) track(nccl.Send(op.send, op.count, op.dtype, op.send_peer, comm.comm, stream));
        if (op.recv_peer >= 0) track(nccl.Recv(op.recv, op.count, op.dtype, op.recv_peer, comm.comm, stream));
        break;
    }
  }
  // The group is always closed, also after a failed call, so NCCL's group state stays balanced.
  r = GroupEnd(nccl, comm);
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
