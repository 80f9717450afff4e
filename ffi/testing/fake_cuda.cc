// The CUDA driver calls jaxdist makes, as a test double (loaded through
// $JAXDIST_CUDA_DRIVER_LIBRARY from the same library as the fake libnccl).
// There is no GPU: a "stream" is one global sequence of recorded events, and
// an event completes when it is recorded, unless the stream was told to stall:
// then every event recorded after the stall point stays pending forever, as
// behind an NCCL kernel that waits for a peer that never comes.
//
// Written without cuda.h on purpose: cuda.h renames several of these symbols
// (cuMemcpyDtoDAsync -> _v2, ...) and the symbol names must be the exact ones
// jaxdist's dynload binds.
#include <mutex>
#include <set>

namespace {

constexpr int kSuccess = 0;
constexpr int kNotReady = 600;  // CUDA_ERROR_NOT_READY

std::mutex mu;
int records = 0;          // events recorded so far
int stall_after = -1;     // events recorded after this many never complete; -1: none stall
std::set<void*> pending;  // events that will never complete

struct FakeEvent {
  int id;
};

}  // namespace

extern "C" {

// Controls, called by the tests through ctypes.
void fake_cuda_stall_after(int n) {
  std::lock_guard<std::mutex> l(mu);
  stall_after = n;
  records = 0;
  pending.clear();
}
int fake_cuda_records() { return records; }

// The driver API.
int cuInit(unsigned) { return kSuccess; }
int cuDeviceGet(int* dev, int ordinal) {
  *dev = ordinal;
  return kSuccess;
}
int cuDevicePrimaryCtxRetain(void** ctx, int) {
  *ctx = reinterpret_cast<void*>(1);
  return kSuccess;
}
int cuCtxSetCurrent(void*) { return kSuccess; }
int cuCtxGetCurrent(void** ctx) {
  *ctx = reinterpret_cast<void*>(1);
  return kSuccess;
}
int cuStreamCreate(void** s, unsigned) {
  *s = reinterpret_cast<void*>(2);
  return kSuccess;
}
int cuEventCreate(void** e, unsigned) {
  *e = new FakeEvent{0};
  return kSuccess;
}
int cuEventRecord(void* e, void*) {
  std::lock_guard<std::mutex> l(mu);
  ++records;
  if (stall_after >= 0 && records > stall_after) {
    pending.insert(e);
  } else {
    pending.erase(e);
  }
  return kSuccess;
}
int cuEventQuery(void* e) {
  std::lock_guard<std::mutex> l(mu);
  return pending.count(e) ? kNotReady : kSuccess;
}
int cuStreamWaitEvent(void*, void*, unsigned) { return kSuccess; }
int cuLaunchHostFunc(void*, void (*)(void*), void*) { return kSuccess; }
int cuMemcpyDtoDAsync_v2(unsigned long long, unsigned long long, unsigned long, void*) { return kSuccess; }
int cuMemsetD8Async(unsigned long long, unsigned char, unsigned long, void*) { return kSuccess; }
int cuGetErrorString(int, const char** s) {
  *s = "fake CUDA error";
  return kSuccess;
}

}  // extern "C"
