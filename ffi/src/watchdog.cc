#include "watchdog.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "comms.h"

namespace jaxdist {
namespace {

std::mutex mu;  // guards everything below
std::condition_variable wake;
std::thread thread;
bool stopping = false;
std::string reason;   // why it tripped: set first, for the record file
std::string failure;  // the full message (with the file's path): set last, for everyone else
std::atomic<int> process_index{-1};
int64_t stuck_key = -1;  // the communicator and op that tripped the watchdog
uint64_t stuck_seq = 0;

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Describe(const Comm& comm, const OpRecord& r, double waited_s) {
  std::string what = std::string(OpName(r.kind)) + " #" + std::to_string(r.seq) + " on axis '" + comm.axis +
                     "' (rank " + std::to_string(comm.rank) + " of " + std::to_string(comm.nranks) + ", device " +
                     std::to_string(comm.device);
  if (process_index >= 0) what += ", process " + std::to_string(process_index.load());
  if (r.step >= 0) what += ", step " + std::to_string(r.step);
  what += ", " + std::to_string(r.count) + " x " + DtypeName(r.dtype) + ")";
  char secs[96];
  std::snprintf(secs, sizeof(secs), "%.1f s (deadline %g s", waited_s, TimeoutMs() / 1000.0);
  return "jaxdist nccl watchdog: " + what + " has not completed after " + secs +
         ", set JAXDIST_NCCL_TIMEOUT_S to change it); " +
         (r.state == OpState::kStarted ? "it started on the GPU and waits for a peer"
                                       : "it has not started on the GPU: an earlier op or kernel is stuck");
}

std::string WriteRecord(const std::string& json) {
  const char* dir = getenv("JAXDIST_FLIGHT_RECORD_DIR");
  std::string d = dir != nullptr && dir[0] != '\0' ? dir : ".";
  std::string path = d + "/jaxdist-flight-record-p" + std::to_string(process_index.load()) + "-pid" +
                     std::to_string(getpid()) + ".json";
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return "";
  std::fwrite(json.data(), 1, json.size(), f);
  std::fclose(f);
  return path;
}

void Loop(int64_t period_ms) {
  std::unique_lock<std::mutex> lock(mu);
  while (!stopping) {
    wake.wait_for(lock, std::chrono::milliseconds(period_ms));
    if (stopping) break;
    lock.unlock();
    WatchdogCheck();
    lock.lock();
  }
}

}  // namespace

void SetProcessIndex(int index) { process_index = index; }

std::string WatchdogFailure() {
  std::lock_guard<std::mutex> lock(mu);
  return failure;
}

std::string FlightRecordJson(bool with_ops) {
  std::string comms;
  ForEachCommOfAllKeys([&](int64_t key, Comm& c) {
    comms += std::string(comms.empty() ? "" : ", ") + "{\"key\": " + std::to_string(key) +
             ", \"axis\": " + JsonString(c.axis) + ", \"rank\": " + std::to_string(c.rank) +
             ", \"nranks\": " + std::to_string(c.nranks) + ", \"device\": " + std::to_string(c.device) +
             ", \"aborted\": " + (c.aborted ? "true" : "false") +
             ", \"last_enqueued\": " + std::to_string(c.recorder.LastEnqueued()) +
             ", \"last_completed\": " + std::to_string(c.recorder.LastCompleted()) +
             (with_ops ? ", \"ops\": " + c.recorder.OpsJson() : std::string()) + "}";
  });
  std::string why;
  std::string stuck = "null";
  {
    std::lock_guard<std::mutex> lock(mu);
    why = reason;
    if (stuck_key >= 0)
      stuck = "{\"key\": " + std::to_string(stuck_key) + ", \"seq\": " + std::to_string(stuck_seq) + "}";
  }
  return "{\"pid\": " + std::to_string(getpid()) + ", \"process\": " + std::to_string(process_index.load()) +
         ", \"step\": " + std::to_string(CurrentStep()) + ", \"timeout_s\": " + std::to_string(TimeoutMs() / 1000.0) +
         ", \"failure\": " + (why.empty() ? "null" : JsonString(why)) + ", \"stuck\": " + stuck +
         ", \"communicators\": [" + comms + "]}";
}

void TripWatchdog(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!reason.empty()) return;
    reason = why;
  }
  // The record first: it shows the states before the abort changes them.
  std::string path = WriteRecord(FlightRecordJson(true));
  std::string msg = why + (path.empty() ? "; the flight record could not be written (JAXDIST_FLIGHT_RECORD_DIR)"
                                        : "; flight record: " + path);
  {
    std::lock_guard<std::mutex> lock(mu);
    failure = msg;
  }
  const NcclApi* nccl = Nccl();
  if (nccl == nullptr) return;
  ForEachCommOfAllKeys([&](int64_t, Comm& c) { Abort(*nccl, c, msg + "; every communicator was aborted"); });
}

void WatchdogCheck() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!reason.empty()) return;
  }
  const int64_t now = SteadyNs();
  const int64_t deadline_ns = TimeoutMs() * 1000000;
  std::string why;
  int64_t key = -1;
  uint64_t seq = 0;
  ForEachCommOfAllKeys([&](int64_t k, Comm& c) {
    if (!why.empty() || c.aborted) return;
    OpRecord r = c.recorder.OldestUnfinished();
    if (r.seq != 0 && now - r.enqueued_ns > deadline_ns) {
      why = Describe(c, r, (now - r.enqueued_ns) / 1e9);
      key = k;
      seq = r.seq;
    }
  });
  if (why.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (reason.empty()) {
      stuck_key = key;
      stuck_seq = seq;
    }
  }
  TripWatchdog(why);
}

void StartWatchdog(int64_t period_ms) {
  std::lock_guard<std::mutex> lock(mu);
  if (thread.joinable()) return;
  stopping = false;
  thread = std::thread(Loop, period_ms);
  // Joined before the registry it reads is destroyed at exit (atexit runs
  // before the destructors of statics constructed earlier).
  static bool registered = (std::atexit(StopWatchdog), true);
  (void)registered;
}

void StopWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  wake.notify_all();
  if (thread.joinable()) thread.join();
}

}  // namespace jaxdist
