#include "dynload.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace jaxdist {
namespace {

template <typename F>
bool Bind(void* lib, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *fn != nullptr;
}

std::mutex load_mutex;
NcclApi nccl_api;
const NcclApi* nccl_loaded = nullptr;
std::string nccl_error;

}  // namespace

const NcclApi* LoadNccl(const char* path, std::string* error) {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (nccl_loaded != nullptr) {
    if (nccl_api.path != path) {
      *error = "NCCL is already loaded from " + nccl_api.path + "; one process can use only one libnccl";
      return nullptr;
    }
    return nccl_loaded;
  }
  // RTLD_NOLOAD first: reuse the copy JAX's CUDA plugin already has open.
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    *error = std::string("cannot load NCCL from ") + path + ": " + (why ? why : "unknown dlopen error");
    return nullptr;
  }
  NcclApi api;
  std::string missing;
  Bind(lib, "ncclGetVersion", &api.GetVersion, &missing);
  Bind(lib, "ncclGetUniqueId", &api.GetUniqueId, &missing);
  Bind(lib, "ncclCommInitRankConfig", &api.CommInitRankConfig, &missing);
  Bind(lib, "ncclCommFinalize", &api.CommFinalize, &missing);
  Bind(lib, "ncclCommDestroy", &api.CommDestroy, &missing);
  Bind(lib, "ncclCommAbort", &api.CommAbort, &missing);
  Bind(lib, "ncclCommGetAsyncError", &api.CommGetAsyncError, &missing);
  Bind(lib, "ncclGetErrorString", &api.GetErrorString, &missing);
  Bind(lib, "ncclGetLastError", &api.GetLastError, &missing);
  Bind(lib, "ncclGroupStart", &api.GroupStart, &missing);
  Bind(lib, "ncclGroupEnd", &api.GroupEnd, &missing);
  Bind(lib, "ncclSend", &api.Send, &missing);
  Bind(lib, "ncclRecv", &api.Recv, &missing);
  Bind(lib, "ncclAllReduce", &api.AllReduce, &missing);
  Bind(lib, "ncclAllGather", &api.AllGather, &missing);
  Bind(lib, "ncclReduceScatter", &api.ReduceScatter, &missing);
  if (!missing.empty()) {
    *error = std::string(path) + " is not a usable NCCL (>= 2.14 needed): missing " + missing;
    dlclose(lib);
    return nullptr;
  }
  api.path = path;
  nccl_api = api;
  nccl_loaded = &nccl_api;
  return nccl_loaded;
}

const NcclApi* Nccl() {
  std::lock_guard<std::mutex> lock(load_mutex);
  return nccl_loaded;
}

const CudaApi* Cuda(std::string* error) {
  static CudaApi api;
  static std::string load_error;
  static bool ok = [] {
    const char* override_path = getenv("JAXDIST_CUDA_DRIVER_LIBRARY");
    const char* path = override_path != nullptr && override_path[0] != '\0' ? override_path : "libcuda.so.1";
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      load_error = std::string("cannot load the CUDA driver ") + path + ": " + (why ? why : "unknown");
      return false;
    }
    std::string missing;
    Bind(lib, "cuInit", &api.Init, &missing);
    Bind(lib, "cuDeviceGet", &api.DeviceGet, &missing);
    Bind(lib, "cuDevicePrimaryCtxRetain", &api.DevicePrimaryCtxRetain, &missing);
    Bind(lib, "cuCtxSetCurrent", &api.CtxSetCurrent, &missing);
    Bind(lib, "cuStreamCreate", &api.StreamCreate, &missing);
    Bind(lib, "cuEventCreate", &api.EventCreate, &missing);
    Bind(lib, "cuEventRecord", &api.EventRecord, &missing);
    Bind(lib, "cuStreamWaitEvent", &api.StreamWaitEvent, &missing);
    Bind(lib, "cuLaunchHostFunc", &api.LaunchHostFunc, &missing);
    Bind(lib, "cuMemcpyDtoDAsync_v2", &api.MemcpyDtoDAsync, &missing);
    Bind(lib, "cuMemsetD8Async", &api.MemsetD8Async, &missing);
    Bind(lib, "cuGetErrorString", &api.GetErrorString, &missing);
    Bind(lib, "cuEventQuery", &api.EventQuery, &missing);
    Bind(lib, "cuCtxGetCurrent", &api.CtxGetCurrent, &missing);
    if (!missing.empty()) {
      load_error = "libcuda.so.1 lacks " + missing;
      return false;
    }
    // Idempotent; needed where nothing (such as JAX's CUDA plugin) initialized the driver yet.
    CUresult r = api.Init(0);
    if (r != CUDA_SUCCESS) load_error = "cuInit failed with CUDA error " + std::to_string(static_cast<int>(r));
    return r == CUDA_SUCCESS;
  }();
  if (!ok && error != nullptr) *error = load_error;
  return ok ? &api : nullptr;
}

}  // namespace jaxdist
