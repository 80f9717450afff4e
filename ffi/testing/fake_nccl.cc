// A test double of libnccl.so.2 for the CPU tests. It moves no data; it
// records every call, in order, and can be told to answer ncclInProgress,
// stay in progress forever, or fail, so the tests can prove jaxdist's call
// protocol (grouping, polling, deadlines, error text) without a GPU.
// It can also act as NCCL does with a non-blocking communicator (a thread
// per ncclGroupEnd, joined by ncclCommGetAsyncError), and hold one rank's
// ncclCommGetAsyncError until released (to prove communicators poll independently).
#include <nccl.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

namespace {

std::mutex mu;
std::string log_text;
int in_progress_left = 0;  // answers of ncclInProgress before success; -1: forever
std::string fail_call;     // the next call of this name fails
ncclResult_t fail_code = ncclSuccess;
std::string last_error;
int aborts = 0;

struct FakeComm {
  int rank, nranks, blocking;
  bool has_job = false;  // a group thread runs for it (simulated non-blocking group end)
  pthread_t job{};
  std::atomic<bool> job_done{false};
};

std::mutex log_mu;  // calls may come from several threads at once
void Log(const std::string& line) {
  std::lock_guard<std::mutex> l(log_mu);
  log_text += line + "\n";
}

// Simulated NCCL group thread: the number of CPUs it may run on (its inherited affinity).
bool group_threads = false;
thread_local FakeComm* group_comm = nullptr;  // the communicator of the open group's ops (groups are per thread)
std::atomic<int> group_thread_cpus{-1};

void* GroupJob(void* arg) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) group_thread_cpus = CPU_COUNT(&set);
  static_cast<FakeComm*>(arg)->job_done = true;
  return nullptr;
}

// The gate: ncclCommGetAsyncError of rank `gate_rank` blocks until the gate opens.
std::mutex gate_mu;
std::condition_variable gate_cv;
int gate_rank = -1;
bool gate_entered = false;
void PassGate(const FakeComm* c) {
  std::unique_lock<std::mutex> g(gate_mu);
  if (c == nullptr || c->rank != gate_rank) return;
  gate_entered = true;
  gate_cv.notify_all();
  gate_cv.wait(g, [c] { return gate_rank != c->rank; });
}

ncclResult_t Answer(const char* name, ncclResult_t ok = ncclSuccess) {
  if (fail_call == name) {
    fail_call.clear();
    Log(std::string(name) + " -> error");
    return fail_code;
  }
  return ok;
}

}  // namespace

extern "C" {

// Controls, called by the tests through ctypes.
void fake_nccl_reset() {
  std::lock_guard<std::mutex> l(mu);
  log_text.clear();
  in_progress_left = 0;
  fail_call.clear();
  last_error.clear();
  aborts = 0;
  group_threads = false;
  group_thread_cpus = -1;
}
// 1: a non-blocking group end starts a thread and answers ncclInProgress, as NCCL does.
void fake_nccl_set_group_threads(int on) { group_threads = on != 0; }
int fake_nccl_group_thread_cpus() { return group_thread_cpus; }
// Holds ncclCommGetAsyncError of `rank` (-1: opens the gate); whether one is held now.
void fake_nccl_gate(int rank) {
  std::lock_guard<std::mutex> g(gate_mu);
  gate_rank = rank;
  gate_entered = false;
  gate_cv.notify_all();
}
int fake_nccl_gate_entered() {
  std::lock_guard<std::mutex> g(gate_mu);
  return gate_entered;
}
const char* fake_nccl_log() { return log_text.c_str(); }
void fake_nccl_set_in_progress(int n) { in_progress_left = n; }
void fake_nccl_fail_next(const char* call, int code, const char* message) {
  fail_call = call;
  fail_code = static_cast<ncclResult_t>(code);
  last_error = message;
}
int fake_nccl_aborts() { return aborts; }

// The NCCL API jaxdist loads.
ncclResult_t ncclGetVersion(int* v) {
  *v = 99999;
  return ncclSuccess;
}
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 7, NCCL_UNIQUE_ID_BYTES);
  Log("GetUniqueId");
  return Answer("GetUniqueId");
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId, int rank, ncclConfig_t* config) {
  std::lock_guard<std::mutex> l(mu);
  Log("CommInitRankConfig rank=" + std::to_string(rank) + " nranks=" + std::to_string(nranks) +
      " blocking=" + std::to_string(config->blocking));
  *comm = reinterpret_cast<ncclComm_t>(new FakeComm{rank, nranks, config->blocking});
  return Answer("CommInitRankConfig", config->blocking ? ncclSuccess : ncclInProgress);
}
ncclResult_t ncclCommFinalize(ncclComm_t) {
  Log("CommFinalize");
  return Answer("CommFinalize");
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Log("CommDestroy");
  if (auto* c = reinterpret_cast<FakeComm*>(comm); c->has_job) pthread_join(c->job, nullptr);
  delete reinterpret_cast<FakeComm*>(comm);
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  Log("CommAbort");
  if (auto* c = reinterpret_cast<FakeComm*>(comm); c->has_job) pthread_join(c->job, nullptr);
  ++aborts;
  delete reinterpret_cast<FakeComm*>(comm);
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  FakeComm* c = reinterpret_cast<FakeComm*>(comm);
  PassGate(c);
  std::lock_guard<std::mutex> l(mu);
  if (c != nullptr && c->has_job) {
    if (!c->job_done) {
      *state = ncclInProgress;
      return ncclSuccess;
    }
    pthread_join(c->job, nullptr);  // as NCCL: the poll that sees the group done joins its thread
    c->has_job = false;
  }
  if (fail_call == "CommGetAsyncError") {
    fail_call.clear();
    *state = fail_code;
    Log("CommGetAsyncError -> error");
    return ncclSuccess;
  }
  if (in_progress_left != 0) {
    if (in_progress_left > 0) --in_progress_left;
    *state = ncclInProgress;
    // Logged once per answer would flood the log on a stuck state; a count is enough.
    if (log_text.size() < (1 << 20)) Log("CommGetAsyncError -> InProgress");
    return ncclSuccess;
  }
  *state = ncclSuccess;
  Log("CommGetAsyncError -> Success");
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}
const char* ncclGetLastError(ncclComm_t) { return last_error.c_str(); }
ncclResult_t ncclGroupStart() {
  Log("GroupStart");
  return Answer("GroupStart");
}
ncclResult_t ncclGroupEnd() {
  Log("GroupEnd");
  ncclResult_t r = Answer("GroupEnd");
  FakeComm* c = group_comm;
  group_comm = nullptr;
  if (r == ncclSuccess && group_threads && c != nullptr && !c->blocking) {
    c->job_done = false;
    if (pthread_create(&c->job, nullptr, GroupJob, c) != 0) return ncclSystemError;
    c->has_job = true;
    return ncclInProgress;
  }
  return r;
}
ncclResult_t ncclSend(const void*, size_t count, ncclDataType_t, int peer, ncclComm_t comm, cudaStream_t) {
  group_comm = reinterpret_cast<FakeComm*>(comm);
  Log("Send peer=" + std::to_string(peer) + " count=" + std::to_string(count));
  return Answer("Send");
}
ncclResult_t ncclRecv(void*, size_t count, ncclDataType_t, int peer, ncclComm_t comm, cudaStream_t) {
  group_comm = reinterpret_cast<FakeComm*>(comm);
  Log("Recv peer=" + std::to_string(peer) + " count=" + std::to_string(count));
  return Answer("Recv");
}
ncclResult_t ncclAllReduce(const void*, void*, size_t count, ncclDataType_t, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t) {
  group_comm = reinterpret_cast<FakeComm*>(comm);
  Log("AllReduce count=" + std::to_string(count) + " op=" + std::to_string(op));
  return Answer("AllReduce");
}
ncclResult_t ncclAllGather(const void*, void*, size_t count, ncclDataType_t, ncclComm_t comm, cudaStream_t) {
  group_comm = reinterpret_cast<FakeComm*>(comm);
  Log("AllGather count=" + std::to_string(count));
  return Answer("AllGather");
}
ncclResult_t ncclReduceScatter(const void*, void*, size_t count, ncclDataType_t, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t) {
  group_comm = reinterpret_cast<FakeComm*>(comm);
  Log("ReduceScatter count=" + std::to_string(count) + " op=" + std::to_string(op));
  return Answer("ReduceScatter");
}

}  // extern "C"
