// The watchdog: one thread per process that asks each communicator's flight
// recorder for its oldest unfinished op. An op unfinished past the deadline
// (TimeoutMs, JAXDIST_NCCL_TIMEOUT_S) trips it: the flight record is written
// to a file, every communicator is aborted (ncclCommAbort, so the stuck
// kernels return) and every later op fails with a message naming the op, its
// axis, its sequence number and this rank. A C++ thread, so that it runs
// while Python is blocked (holding the GIL or not) in block_until_ready.
#pragma once

#include <cstdint>
#include <string>

namespace jaxdist {

// Starts the thread (idempotent); it checks every `period_ms`.
void StartWatchdog(int64_t period_ms);
void StopWatchdog();
// One check of every communicator, as the thread does (tests call it directly).
void WatchdogCheck();
// Trips the watchdog with `why` (also from Python: a peer reported a failure).
// Writes the flight record, aborts every communicator. Idempotent: the first
// reason wins.
void TripWatchdog(const std::string& why);
// The failure message, or "" while nothing tripped.
std::string WatchdogFailure();
// Every communicator's records as one JSON object; without the ops, just
// each communicator's last enqueued and completed sequence numbers.
std::string FlightRecordJson(bool with_ops);
// The process index and rank-of-process the file name and dump carry.
void SetProcessIndex(int index);

}  // namespace jaxdist
