// Stand-in for the CUDA runtime header that nccl.h includes. jaxdist calls
// the driver API only (dlopen'ed libcuda.so.1) and needs just the stream
// type from the runtime, which is the driver's CUstream. The real
// cuda_runtime.h pulls in nvcc's crt/ headers, which no runtime wheel ships.
#pragma once
#include <cuda.h>

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
// Below 11000 so nccl.h skips the bf16/fp8 device-type headers it does not need here.
#define CUDART_VERSION 10000
