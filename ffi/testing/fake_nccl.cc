// A test double of libnccl.so.2 for the CPU tests. It moves no data; it
// records every call, in order, and can be told to answer ncclInProgress,
// stay in progress forever, or fail, so the tests can prove jaxdist's call
// protocol (grouping, polling, deadlines, error text) without a GPU.
#include <nccl.h>

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
};

void Log(const std::string& line) { log_text += line + "\n"; }

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
ncclResult_t ncclGetVersion(int* v) { *v = 99999; return ncclSuccess; }
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
ncclResult_t ncclCommFinalize(ncclComm_t) { Log("CommFinalize"); return Answer("CommFinalize"); }
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Log("CommDestroy");
  delete reinterpret_cast<FakeComm*>(comm);
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  Log("CommAbort");
  ++aborts;
  delete reinterpret_cast<FakeComm*>(comm);
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t* state) {
  std::lock_guard<std::mutex> l(mu);
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
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}
const char* ncclGetLastError(ncclComm_t) { return last_error.c_str(); }
ncclResult_t ncclGroupStart() { Log("GroupStart"); return Answer("GroupStart"); }
ncclResult_t ncclGroupEnd() { Log("GroupEnd"); return Answer("GroupEnd"); }
ncclResult_t ncclSend(const void*, size_t count, ncclDataType_t, int peer, ncclComm_t, cudaStream_t) {
  Log("Send peer=" + std::to_string(peer) + " count=" + std::to_string(count));
  return Answer("Send");
}
ncclResult_t ncclRecv(void*, size_t count, ncclDataType_t, int peer, ncclComm_t, cudaStream_t) {
  Log("Recv peer=" + std::to_string(peer) + " count=" + std::to_string(count));
  return Answer("Recv");
}
ncclResult_t ncclAllReduce(const void*, void*, size_t count, ncclDataType_t, ncclRedOp_t op, ncclComm_t, cudaStream_t) {
  Log("AllReduce count=" + std::to_string(count) + " op=" + std::to_string(op));
  return Answer("AllReduce");
}
ncclResult_t ncclAllGather(const void*, void*, size_t count, ncclDataType_t, ncclComm_t, cudaStream_t) {
  Log("AllGather count=" + std::to_string(count));
  return Answer("AllGather");
}
ncclResult_t ncclReduceScatter(const void*, void*, size_t count, ncclDataType_t, ncclRedOp_t op, ncclComm_t,
                               cudaStream_t) {
  Log("ReduceScatter count=" + std::to_string(count) + " op=" + std::to_string(op));
  return Answer("ReduceScatter");
}

}  // extern "C"
