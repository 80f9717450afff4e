// The flight recorder: every op enqueued on a communicator gets the next
// sequence number of that communicator and a slot in a fixed-size ring of
// records (op, dtype, count, peers, step, enqueue time). Two CUDA events
// around the op on its stream say whether the GPU has started and finished
// it. The watchdog (watchdog.h) reads the oldest unfinished record; the
// records are dumped as JSON on demand and on a failure.
//
// Cost per op: a mutex, two clock reads and two cuEventRecord calls (every
// slot's events are created at the first op and reused when the ring wraps).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dynload.h"

namespace jaxdist {

enum class OpKind { kAllReduce = 0, kAllGather = 1, kReduceScatter = 2, kSendRecv = 3 };
const char* OpName(OpKind kind);

enum class OpState { kEnqueued = 0, kStarted = 1, kCompleted = 2 };

struct OpRecord {
  uint64_t seq = 0;  // 0: an empty slot
  OpKind kind = OpKind::kAllReduce;
  ncclDataType_t dtype = ncclFloat32;
  size_t count = 0;
  int send_peer = -1;
  int recv_peer = -1;
  int64_t step = -1;         // the step the host was in (set_step), -1 unknown
  int64_t enqueued_ns = 0;   // steady clock: the deadline's start
  double enqueued_unix = 0;  // wall clock: for people reading the dump
  bool has_events = false;   // false where no CUDA driver is loaded: the state is unknown
  OpState state = OpState::kEnqueued;
  CUevent started = nullptr;   // recorded on the stream before the op
  CUevent finished = nullptr;  // and after it
};

class FlightRecorder {
 public:
  // Ring size; JAXDIST_FLIGHT_RECORD_SIZE overrides it (read once per process).
  static size_t Capacity();

  // Takes the next sequence number, fills its slot and records the "started"
  // event on `stream`. Returns the sequence number.
  uint64_t Begin(OpKind kind, ncclDataType_t dtype, size_t count, int send_peer, int recv_peer, cudaStream_t stream);
  // Records the "finished" event of `seq` on `stream` (after the op is enqueued).
  void End(uint64_t seq, cudaStream_t stream);

  // Queries the events of unfinished records (any thread) and returns a copy of
  // the oldest record still unfinished, or one with seq 0 if there is none.
  OpRecord OldestUnfinished();
  uint64_t LastEnqueued();
  uint64_t LastCompleted();  // every op up to this one has finished
  // The ring as a JSON array, oldest first, after refreshing the states.
  std::string OpsJson();

 private:
  void RefreshLocked();
  OpRecord& Slot(uint64_t seq) { return slots_[(seq - 1) % slots_.size()]; }

  std::mutex mu_;
  std::vector<OpRecord> slots_;
  uint64_t next_seq_ = 1;
  uint64_t completed_ = 0;
  CUcontext ctx_ = nullptr;  // the context the events live in: the watchdog thread makes it current
};

// The step the host is running; recorded with every op. -1: unknown.
void SetCurrentStep(int64_t step);
int64_t CurrentStep();
// Whether ops are recorded at all (JAXDIST_FLIGHT_RECORDER=0 turns it off, for the benchmark).
void SetRecorderEnabled(bool on);
bool RecorderEnabled();

std::string DtypeName(ncclDataType_t t);
std::string JsonString(const std::string& s);

}  // namespace jaxdist
