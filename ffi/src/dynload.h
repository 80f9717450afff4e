// Run-time loading of NCCL and the CUDA driver API. jaxdist never links
// against either: it must use the one libnccl.so.2 JAX's CUDA plugin loaded
// (two copies in one process break NCCL group semantics), and it must import
// on machines with no GPU at all.
#pragma once

#include <cuda.h>
#include <nccl.h>

#include <string>

namespace jaxdist {

struct NcclApi {
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  ncclResult_t (*CommFinalize)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  const char* (*GetErrorString)(ncclResult_t);
  const char* (*GetLastError)(ncclComm_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  std::string path;
};

struct CudaApi {
  CUresult (*Init)(unsigned int);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*StreamCreate)(CUstream*, unsigned int);
  CUresult (*EventCreate)(CUevent*, unsigned int);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned int);
  CUresult (*LaunchHostFunc)(CUstream, CUhostFn, void*);
  CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*GetErrorString)(CUresult, const char**);
  // The flight recorder's: whether an op's events have been reached, from any thread.
  CUresult (*EventQuery)(CUevent);
  CUresult (*CtxGetCurrent)(CUcontext*);
};

// Loads libnccl from `path` once per process. Returns nullptr and sets
// `error` on failure; later calls return the first result.
const NcclApi* LoadNccl(const char* path, std::string* error);
const NcclApi* Nccl();  // nullptr until LoadNccl succeeded

// Loads the CUDA driver API from libcuda.so.1 once per process
// ($JAXDIST_CUDA_DRIVER_LIBRARY overrides the path: the CPU tests point it at
// the test double, which can hold an event forever).
const CudaApi* Cuda(std::string* error);

}  // namespace jaxdist
