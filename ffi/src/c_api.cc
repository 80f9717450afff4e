// The C entry points jaxdist.comm.nccl calls through ctypes: loading NCCL,
// creating and destroying communicators, settings, and a stream-less entry
// that runs the issue-and-poll protocol for the CPU tests.
#include <cstring>
#include <string>
#include <vector>

#include "comms.h"
#include "dynload.h"
#include "watchdog.h"

using namespace jaxdist;

namespace {

int Report(const std::string& msg, char* err, int errlen) {
  if (err != nullptr && errlen > 0) {
    std::strncpy(err, msg.c_str(), errlen - 1);
    err[errlen - 1] = '\0';
  }
  return msg.empty() ? 0 : 1;
}

const NcclApi* Require(char* err, int errlen) {
  const NcclApi* nccl = Nccl();
  if (nccl == nullptr) Report("NCCL is not loaded; call jaxdist_nccl_load first", err, errlen);
  return nccl;
}

// Makes `device`'s primary context current so NCCL creates the communicator
// on it. Skipped where there is no driver (the CPU test double needs none).
std::string UseDevice(int device) {
  std::string why;
  const CudaApi* cuda = Cuda(&why);
  if (cuda == nullptr || device < 0) return "";
  CUdevice dev;
  CUcontext ctx;
  if (cuda->DeviceGet(&dev, device) != CUDA_SUCCESS || cuda->DevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cuda->CtxSetCurrent(ctx) != CUDA_SUCCESS) {
    return "cannot make CUDA device " + std::to_string(device) + " current";
  }
  return "";
}

}  // namespace

extern "C" {

int jaxdist_nccl_load(const char* path, char* err, int errlen) {
  std::string why;
  return LoadNccl(path, &why) ? 0 : Report(why, err, errlen);
}

int jaxdist_nccl_version() {
  const NcclApi* nccl = Nccl();
  int v = 0;
  if (nccl != nullptr) nccl->GetVersion(&v);
  return v;
}

int jaxdist_nccl_unique_id(char* out, char* err, int errlen) {
  const NcclApi* nccl = Require(err, errlen);
  if (nccl == nullptr) return 1;
  ncclUniqueId id;
  ncclResult_t r = nccl->GetUniqueId(&id);
  if (r != ncclSuccess) return Report(std::string("ncclGetUniqueId: ") + nccl->GetErrorString(r), err, errlen);
  std::memcpy(out, id.internal, NCCL_UNIQUE_ID_BYTES);
  return 0;
}

int jaxdist_unique_id_bytes() { return NCCL_UNIQUE_ID_BYTES; }

// Creates the communicators of mesh-axis `key` for `n` local devices: device
// devices[i] is rank ranks[i] of a group of nranks[i] identified by
// ids[i * NCCL_UNIQUE_ID_BYTES ...]. The inits are grouped, as NCCL requires
// when one thread creates several ranks. Non-blocking communicators are left
// initializing; their first use (or jaxdist_comm_wait_ready) waits.
int jaxdist_comm_init(int64_t key, int n, const char* ids, const int* nranks, const int* ranks, const int* devices,
                      int blocking, const char* axis, char* err, int errlen) {
  const NcclApi* nccl = Require(err, errlen);
  if (nccl == nullptr) return 1;
  std::vector<Comm*> made;
  for (int i = 0; i < n; ++i) {
    Comm* c = AddComm(key, devices[i]);
    c->rank = ranks[i];
    c->nranks = nranks[i];
    c->blocking = blocking != 0;
    c->axis = axis;
    made.push_back(c);
  }
  nccl->GroupStart();
  std::string failure;
  for (int i = 0; i < n && failure.empty(); ++i) {
    failure = UseDevice(devices[i]);
    if (!failure.empty()) break;
    ncclUniqueId id;
    std::memcpy(id.internal, ids + static_cast<size_t>(i) * NCCL_UNIQUE_ID_BYTES, NCCL_UNIQUE_ID_BYTES);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    ncclResult_t r = nccl->CommInitRankConfig(&made[i]->comm, nranks[i], id, ranks[i], &config);
    if (r != ncclSuccess && r != ncclInProgress) failure = Describe(*nccl, *made[i], "init", r);
  }
  ncclResult_t end = nccl->GroupEnd();
  if (failure.empty() && end != ncclSuccess && end != ncclInProgress) {
    failure = Describe(*nccl, *made[0], "init", end);
  }
  for (Comm* c : made) {
    if (!failure.empty()) break;
    if (c->blocking) {
      failure = Poll(*nccl, *c, "init", end);
      c->ready = failure.empty();
    }
  }
  if (!failure.empty()) {
    for (Comm* c : made)
      if (c->comm != nullptr && !c->aborted) nccl->CommAbort(c->comm);
    RemoveComms(key);
    return Report(failure, err, errlen);
  }
  return 0;
}

// Waits until every communicator of `key` finished its (non-blocking) init.
int jaxdist_comm_wait_ready(int64_t key, char* err, int errlen) {
  const NcclApi* nccl = Require(err, errlen);
  if (nccl == nullptr) return 1;
  std::string failure;
  ForEachComm(key, [&](Comm& c) {
    if (failure.empty()) failure = EnsureReady(*nccl, c, "init");
  });
  return Report(failure, err, errlen);
}

// Finalizes (polling to completion) and destroys every communicator of `key`.
int jaxdist_comm_destroy(int64_t key, char* err, int errlen) {
  const NcclApi* nccl = Require(err, errlen);
  if (nccl == nullptr) return 1;
  std::string failure;
  ForEachComm(key, [&](Comm& c) {
    if (c.aborted || c.comm == nullptr) return;
    std::string e = EnsureReady(*nccl, c, "finalize");
    if (e.empty()) e = Poll(*nccl, c, "finalize", nccl->CommFinalize(c.comm));
    if (e.empty()) {
      nccl->CommDestroy(c.comm);
    } else if (failure.empty()) {
      failure = e;
    }
    c.comm = nullptr;
  });
  RemoveComms(key);
  return Report(failure, err, errlen);
}

void jaxdist_set_timeout_ms(int64_t ms) { SetTimeoutMs(ms); }

// The flight recorder and the watchdog (flight_recorder.h, watchdog.h).
void jaxdist_watchdog_start(int64_t period_ms) { StartWatchdog(period_ms); }
void jaxdist_watchdog_stop() { StopWatchdog(); }
void jaxdist_watchdog_check() { WatchdogCheck(); }
void jaxdist_watchdog_trip(const char* why) { TripWatchdog(why); }
void jaxdist_flight_set_step(int64_t step) { SetCurrentStep(step); }
void jaxdist_flight_set_process(int index) { SetProcessIndex(index); }
void jaxdist_flight_set_enabled(int on) { SetRecorderEnabled(on != 0); }

// Copies a string into (out, len) if it fits; returns its length (call again with more room).
static int64_t CopyOut(const std::string& s, char* out, int64_t len) {
  if (out != nullptr && len > static_cast<int64_t>(s.size())) std::memcpy(out, s.c_str(), s.size() + 1);
  return static_cast<int64_t>(s.size());
}
int64_t jaxdist_watchdog_failure(char* out, int64_t len) { return CopyOut(WatchdogFailure(), out, len); }
int64_t jaxdist_flight_record(int with_ops, char* out, int64_t len) {
  return CopyOut(FlightRecordJson(with_ops != 0), out, len);
}
void jaxdist_set_debug_delay_us(int64_t us) { SetDebugDelayUs(us); }
void jaxdist_set_poll_mode(int mode) { SetPollMode(mode); }
// How often polls yielded and slept since the last reset: out[0] yields, out[1] sleeps.
void jaxdist_poll_counts(int64_t* out) {
  PollCounts c = GetPollCounts();
  out[0] = c.yields;
  out[1] = c.sleeps;
}
void jaxdist_poll_counts_reset() { ResetPollCounts(); }

// The protocol without a GPU: issue `kind` on the communicator of (key,
// device) with no stream and no data, exactly as a handler would. For tests
// against the recording test-double libnccl.
int jaxdist_test_issue(int64_t key, int device, int kind, int64_t count, int send_peer, int recv_peer, char* err,
                       int errlen) {
  const NcclApi* nccl = Require(err, errlen);
  if (nccl == nullptr) return 1;
  Comm* comm = FindComm(key, device);
  if (comm == nullptr) return Report("no communicator for this key and device", err, errlen);
  static char scratch[64];
  OpDesc op;
  op.kind = static_cast<OpKind>(kind);
  op.send = scratch;
  op.recv = scratch;
  op.count = static_cast<size_t>(count);
  op.send_peer = send_peer;
  op.recv_peer = recv_peer;
  return Report(Issue(*nccl, *comm, op, nullptr), err, errlen);
}

// The same for a group of `n` collectives of one kind, `count` elements each (a start_group's protocol).
int jaxdist_test_issue_group(int64_t key, int device, int kind, int64_t count, int n, char* err, int errlen) {
  const NcclApi* nccl = Require(err, errlen);
  if (nccl == nullptr) return 1;
  Comm* comm = FindComm(key, device);
  if (comm == nullptr) return Report("no communicator for this key and device", err, errlen);
  static char scratch[64];
  std::vector<OpDesc> ops(n > 0 ? n : 0);
  for (OpDesc& op : ops) {
    op.kind = static_cast<OpKind>(kind);
    op.send = scratch;
    op.recv = scratch;
    op.count = static_cast<size_t>(count);
  }
  return Report(IssueGroup(*nccl, *comm, ops.data(), ops.size(), nullptr), err, errlen);
}

}  // extern "C"
