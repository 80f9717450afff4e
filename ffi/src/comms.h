// Communicators, and the one protocol every NCCL call follows: issue inside
// a group, then poll ncclCommGetAsyncError until the communicator leaves
// ncclInProgress, with a deadline. A handler returns (or records an event)
// only after that, so with non-blocking communicators no kernel can be
// missing from the stream when the event is recorded (docs/design.md).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "dynload.h"
#include "flight_recorder.h"

namespace jaxdist {

struct Comm {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int nranks = 1;
  int device = -1;
  bool blocking = true;
  bool ready = false;                // non-blocking init finished
  std::atomic<bool> aborted{false};  // the watchdog thread may abort it
  // Guards NCCL calls on `comm` against an abort (and NCCL's free) from another
  // thread. One per communicator: the threads of other devices, each polling its
  // own communicator, never wait on it (a poll can include joining NCCL's group thread).
  std::mutex mu;
  std::string axis;
  std::string failure;  // set once aborted; every later use reports it
  FlightRecorder recorder;
};

// Deadline for one poll loop, and the injected delay before each NCCL op.
void SetTimeoutMs(int64_t ms);
// How Poll waits for a non-blocking communicator. Each of its ncclGroupEnd calls
// hands the launch to a new thread of NCCL's own (NCCL 2.28 src/group.cc), which
// Poll waits for. In the first 500 us:
enum class PollMode {
  kYield = 0,  // yield the CPU between polls
  kSpin = 1,   // busy-poll
  // busy-poll kSpinPolls polls, then yield; NCCL's group thread is started on the
  // issuing CPU (it inherits a one-CPU affinity), so it runs the moment the poller
  // yields, on warm caches, instead of waiting for an idle core to wake (the default)
  kLocal = 2,
};
// After 500 us every mode sleeps with back-off (20 us doubling to 1 ms).
void SetPollMode(int mode);
PollMode GetPollMode();
constexpr int kSpinPolls = 8;
// How often Poll yielded and slept since the last reset (for the tests).
struct PollCounts {
  int64_t yields = 0;
  int64_t sleeps = 0;
};
PollCounts GetPollCounts();
void ResetPollCounts();
int64_t TimeoutMs();
void SetDebugDelayUs(int64_t us);
int64_t DebugDelayUs();

// Polls until `comm` leaves ncclInProgress. On an error or a passed deadline
// the communicator is aborted and the returned message (empty on success)
// names the op, the axis, the rank and NCCL's own words.
std::string Poll(const NcclApi& nccl, Comm& comm, const char* op, ncclResult_t issued);

// The message for a failed call, without polling.
std::string Describe(const NcclApi& nccl, const Comm& comm, const char* op, ncclResult_t r,
                     const std::string& extra = "");

// Aborts `comm` (once) and makes `msg` the failure every later use reports.
std::string Abort(const NcclApi& nccl, Comm& comm, const std::string& msg);

// Waits for a non-blocking init to finish (first use of the communicator).
std::string EnsureReady(const NcclApi& nccl, Comm& comm, const char* op);

struct OpDesc {
  OpKind kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count =
      0;  // elements sent per rank (all_gather/sendrecv) or reduced (all_reduce); per-rank result for reduce_scatter
  ncclDataType_t dtype = ncclFloat32;
  ncclRedOp_t redop = ncclSum;
  int send_peer = -1;  // sendrecv: rank to send to, or -1
  int recv_peer = -1;  // sendrecv: rank to receive from, or -1
};

// Issues one op on `stream`: group start, the NCCL call(s), group end, poll.
// `grouped=false` is the benchmark's measure of the group's cost: collectives on
// blocking communicators only (it refuses the rest).
std::string Issue(const NcclApi& nccl, Comm& comm, const OpDesc& op, cudaStream_t stream, bool grouped = true);

// Issues `n` ops on `stream` inside one group (one NCCL launch for all of them), then polls:
// a bucket's per-parameter collectives, with no copies into one flat buffer.
std::string IssueGroup(const NcclApi& nccl, Comm& comm, const OpDesc* ops, size_t n, cudaStream_t stream);

// Registry of communicators: one per (key, local device). A key names one
// mesh axis of one mesh; each device holds the communicator of its group.
Comm* FindComm(int64_t key, int device);
Comm* AddComm(int64_t key, int device);
void ForEachComm(int64_t key, const std::function<void(Comm&)>& fn);
void RemoveComms(int64_t key);
void ForEachCommOfAllKeys(const std::function<void(int64_t key, Comm&)>& fn);

}  // namespace jaxdist
