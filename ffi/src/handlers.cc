// XLA FFI handlers: the nccl backend of jaxdist.comm.
//
// jaxdist_nccl_collective   one op on XLA's compute stream.
// jaxdist_nccl_start        records an event on the compute stream, makes the
//                           communication stream wait on it, issues the op
//                           there and records a done event. Its first result
//                           aliases the input, so XLA keeps the input alive.
// jaxdist_nccl_wait         makes the compute stream wait on the done event;
//                           its result aliases the start's output buffer.
// jaxdist_nccl_start_group  jaxdist_nccl_start for several collectives of one kind
// jaxdist_nccl_wait_group   at once: one NCCL group (one launch) over every
//                           operand in place, one done event (a DDP bucket's
//                           parameters without copies into one flat buffer).
// jaxdist_memcpy            a device-to-device copy: the cost floor of any
//                           FFI op, for the micro-benchmark.
// jaxdist_bench_ungrouped   benchmark only: a collective without the group
//                           around it, to measure what the group costs.
//
// None is marked command-buffer compatible: each call must run its host code.
#include <unistd.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "comms.h"
#include "dynload.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace jaxdist;

namespace {

ffi::Error Fail(const std::string& msg) { return ffi::Error(ffi::ErrorCode::kInternal, msg); }

bool ToNccl(ffi::DataType t, ncclDataType_t* out) {
  switch (t) {
    case ffi::DataType::F32:
      *out = ncclFloat32;
      return true;
    case ffi::DataType::BF16:
      *out = ncclBfloat16;
      return true;
    case ffi::DataType::F16:
      *out = ncclFloat16;
      return true;
    case ffi::DataType::F64:
      *out = ncclFloat64;
      return true;
    case ffi::DataType::S8:
      *out = ncclInt8;
      return true;
    case ffi::DataType::U8:
      *out = ncclUint8;
      return true;
    case ffi::DataType::S32:
      *out = ncclInt32;
      return true;
    case ffi::DataType::U32:
      *out = ncclUint32;
      return true;
    case ffi::DataType::S64:
      *out = ncclInt64;
      return true;
    case ffi::DataType::U64:
      *out = ncclUint64;
      return true;
    default:
      return false;
  }
}

ncclRedOp_t ToRedOp(int64_t op) {
  switch (op) {
    case 1:
      return ncclAvg;
    case 2:
      return ncclMax;
    case 3:
      return ncclMin;
    default:
      return ncclSum;
  }
}

std::string CudaError(const CudaApi& cuda, CUresult r, const char* what) {
  const char* s = nullptr;
  cuda.GetErrorString(r, &s);
  return std::string("jaxdist nccl: ") + what + " failed: " + (s ? s : "unknown CUDA error");
}

// Per device: the side stream async ops run on, and their events.
struct DeviceStreams {
  CUstream comm = nullptr;
  CUevent ready = nullptr;
  std::map<int64_t, CUevent> done;  // by op_id: one event per async op site
};
std::mutex streams_mutex;
std::map<int, DeviceStreams> streams;

std::string GetStreams(const CudaApi& cuda, int device, int64_t op_id, DeviceStreams** out, CUevent* done) {
  std::lock_guard<std::mutex> lock(streams_mutex);
  DeviceStreams& s = streams[device];
  CUresult r = CUDA_SUCCESS;
  if (s.comm == nullptr && (r = cuda.StreamCreate(&s.comm, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS)
    return CudaError(cuda, r, "cuStreamCreate");
  if (s.ready == nullptr && (r = cuda.EventCreate(&s.ready, CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS)
    return CudaError(cuda, r, "cuEventCreate");
  CUevent& ev = s.done[op_id];
  if (ev == nullptr && (r = cuda.EventCreate(&ev, CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS)
    return CudaError(cuda, r, "cuEventCreate");
  *out = &s;
  *done = ev;
  return "";
}

void SleepOnStream(void* us) { usleep(static_cast<useconds_t>(reinterpret_cast<intptr_t>(us))); }

struct Env {
  const NcclApi* nccl;
  const CudaApi* cuda;
  Comm* comm;
};

std::string Lookup(int device, int64_t key, Env* env) {
  env->nccl = Nccl();
  if (env->nccl == nullptr) return "jaxdist nccl: NCCL is not loaded; call jaxdist.comm.nccl.init(mesh) first";
  std::string why;
  env->cuda = Cuda(&why);
  if (env->cuda == nullptr) return "jaxdist nccl: " + why;
  env->comm = FindComm(key, device);
  if (env->comm == nullptr)
    return "jaxdist nccl: no communicator for this mesh axis on device " + std::to_string(device) +
           "; call jaxdist.comm.nccl.init(mesh) before running the program";
  return "";
}

std::string Describe(OpDesc* op, int64_t kind, const Comm& comm, ffi::AnyBuffer x, void* y, size_t y_count,
                     int64_t redop, ffi::Span<const int64_t> src, ffi::Span<const int64_t> dst) {
  op->kind = static_cast<OpKind>(kind);
  if (!ToNccl(x.element_type(), &op->dtype)) return "jaxdist nccl: unsupported dtype";
  op->send = x.untyped_data();
  op->recv = y;
  op->redop = ToRedOp(redop);
  op->count = op->kind == OpKind::kReduceScatter ? y_count : x.element_count();
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == comm.rank) op->send_peer = static_cast<int>(dst[i]);
    if (dst[i] == comm.rank) op->recv_peer = static_cast<int>(src[i]);
  }
  return "";
}

// Delay hook, zero-fill of a rank that receives nothing, then the op.
std::string Enqueue(const Env& env, const OpDesc& op, size_t y_bytes, CUstream stream, bool grouped = true) {
  if (int64_t us = DebugDelayUs(); us > 0) {
    CUresult r = env.cuda->LaunchHostFunc(stream, SleepOnStream, reinterpret_cast<void*>(static_cast<intptr_t>(us)));
    if (r != CUDA_SUCCESS) return CudaError(*env.cuda, r, "cuLaunchHostFunc");
  }
  if (op.kind == OpKind::kSendRecv && op.recv_peer < 0) {
    CUresult r = env.cuda->MemsetD8Async(reinterpret_cast<CUdeviceptr>(op.recv), 0, y_bytes, stream);
    if (r != CUDA_SUCCESS) return CudaError(*env.cuda, r, "cuMemsetD8Async");
  }
  return Issue(*env.nccl, *env.comm, op, reinterpret_cast<cudaStream_t>(stream), grouped);
}

ffi::Error Collective(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t key,
                      int64_t kind, int64_t redop, ffi::Span<const int64_t> src, ffi::Span<const int64_t> dst,
                      bool grouped) {
  Env env;
  OpDesc op{};
  std::string err = Lookup(device, key, &env);
  if (err.empty()) err = Describe(&op, kind, *env.comm, x, y->untyped_data(), y->element_count(), redop, src, dst);
  if (err.empty()) err = Enqueue(env, op, y->size_bytes(), reinterpret_cast<CUstream>(stream), grouped);
  return err.empty() ? ffi::Error::Success() : Fail(err);
}

ffi::Error CollectiveImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          int64_t key, int64_t kind, int64_t redop, ffi::Span<const int64_t> src,
                          ffi::Span<const int64_t> dst) {
  return Collective(stream, device, x, y, key, kind, redop, src, dst, true);
}

// Benchmark only: the same collective without ncclGroupStart/End around it.
ffi::Error UngroupedImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         int64_t key, int64_t kind, int64_t redop, ffi::Span<const int64_t> src,
                         ffi::Span<const int64_t> dst) {
  return Collective(stream, device, x, y, key, kind, redop, src, dst, false);
}

// The part of a start shared by one op and a group: order the side stream after the compute
// stream, issue (with the delay hook), then record the done event once the enqueue is complete.
std::string StartOnSideStream(const Env& env, int32_t device, int64_t op_id, CUstream compute,
                              const std::function<std::string(CUstream)>& issue) {
  DeviceStreams* s = nullptr;
  CUevent done = nullptr;
  std::string err = GetStreams(*env.cuda, device, op_id, &s, &done);
  if (!err.empty()) return err;
  CUresult r = env.cuda->EventRecord(s->ready, compute);
  if (r == CUDA_SUCCESS) r = env.cuda->StreamWaitEvent(s->comm, s->ready, 0);
  if (r != CUDA_SUCCESS) return CudaError(*env.cuda, r, "ordering the communication stream");
  err = issue(s->comm);
  if (!err.empty()) return err;
  // Recorded only after Issue polled the op to completion of its enqueue.
  r = env.cuda->EventRecord(done, s->comm);
  return r == CUDA_SUCCESS ? "" : CudaError(*env.cuda, r, "cuEventRecord");
}

ffi::Error StartImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> x_alias,
                     ffi::Result<ffi::AnyBuffer> y, int64_t key, int64_t kind, int64_t redop,
                     ffi::Span<const int64_t> src, ffi::Span<const int64_t> dst, int64_t op_id) {
  Env env;
  OpDesc op{};
  std::string err = Lookup(device, key, &env);
  if (err.empty()) err = Describe(&op, kind, *env.comm, x, y->untyped_data(), y->element_count(), redop, src, dst);
  if (err.empty())
    err = StartOnSideStream(env, device, op_id, reinterpret_cast<CUstream>(stream),
                            [&](CUstream side) { return Enqueue(env, op, y->size_bytes(), side); });
  return err.empty() ? ffi::Error::Success() : Fail(err);
}

// Makes the compute stream wait on the done event of the start of `op_id`.
ffi::Error WaitFor(cudaStream_t stream, int32_t device, int64_t op_id) {
  std::string why;
  const CudaApi* cuda = Cuda(&why);
  if (cuda == nullptr) return Fail("jaxdist nccl: " + why);
  CUevent done = nullptr;
  {
    std::lock_guard<std::mutex> lock(streams_mutex);
    auto it = streams.find(device);
    if (it != streams.end()) {
      auto jt = it->second.done.find(op_id);
      if (jt != it->second.done.end()) done = jt->second;
    }
  }
  if (done == nullptr) return Fail("jaxdist nccl: wait without a matching start on device " + std::to_string(device));
  CUresult r = cuda->StreamWaitEvent(reinterpret_cast<CUstream>(stream), done, 0);
  return r == CUDA_SUCCESS ? ffi::Error::Success() : Fail(CudaError(*cuda, r, "cuStreamWaitEvent"));
}

ffi::Error WaitImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x_alias, ffi::AnyBuffer y,
                    ffi::Result<ffi::AnyBuffer> y_out, int64_t op_id) {
  return WaitFor(stream, device, op_id);
}

// The operands (the start's n aliases, then its n results) only keep their buffers alive until here.
ffi::Error WaitGroupImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs buffers, ffi::RemainingRets ys,
                         int64_t op_id) {
  if (buffers.size() != 2 * ys.size())
    return Fail("jaxdist nccl: a group wait takes the start's n aliases and n results and returns n results");
  return WaitFor(stream, device, op_id);
}

ffi::Error StartGroupImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs xs, ffi::RemainingRets rets,
                          int64_t key, int64_t kind, int64_t redop, int64_t op_id) {
  const size_t n = xs.size();
  if (n == 0 || rets.size() != 2 * n)
    return Fail("jaxdist nccl: a group start takes n >= 1 operands and returns their n aliases and n results");
  if (static_cast<OpKind>(kind) == OpKind::kSendRecv) return Fail("jaxdist nccl: a group holds collectives only");
  Env env;
  std::string err = Lookup(device, key, &env);
  if (!err.empty()) return Fail(err);
  std::vector<OpDesc> ops(n);
  for (size_t i = 0; i < n && err.empty(); ++i) {
    auto x = xs.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(n + i);
    if (x.has_error() || y.has_error()) return Fail("jaxdist nccl: a group operand or result is not a buffer");
    err = Describe(&ops[i], kind, *env.comm, x.value(), (*y)->untyped_data(), (*y)->element_count(), redop, {}, {});
  }
  if (err.empty())
    err = StartOnSideStream(env, device, op_id, reinterpret_cast<CUstream>(stream), [&](CUstream side) {
      if (int64_t us = DebugDelayUs(); us > 0) {
        CUresult r = env.cuda->LaunchHostFunc(side, SleepOnStream, reinterpret_cast<void*>(static_cast<intptr_t>(us)));
        if (r != CUDA_SUCCESS) return CudaError(*env.cuda, r, "cuLaunchHostFunc");
      }
      return IssueGroup(*env.nccl, *env.comm, ops.data(), n, reinterpret_cast<cudaStream_t>(side));
    });
  return err.empty() ? ffi::Error::Success() : Fail(err);
}

ffi::Error MemcpyImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  std::string why;
  const CudaApi* cuda = Cuda(&why);
  if (cuda == nullptr) return Fail("jaxdist memcpy: " + why);
  CUresult r = cuda->MemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(y->untyped_data()),
                                     reinterpret_cast<CUdeviceptr>(x.untyped_data()), x.size_bytes(),
                                     reinterpret_cast<CUstream>(stream));
  return r == CUDA_SUCCESS ? ffi::Error::Success() : Fail(CudaError(*cuda, r, "cuMemcpyDtoDAsync"));
}

}  // namespace

namespace {
// The signature of a one-shot collective: the handler and its ungrouped benchmark twin.
auto CollectiveBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("comm_key")
      .Attr<int64_t>("kind")
      .Attr<int64_t>("redop")
      .Attr<ffi::Span<const int64_t>>("perm_src")
      .Attr<ffi::Span<const int64_t>>("perm_dst");
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdist_nccl_collective, CollectiveImpl, CollectiveBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdist_bench_ungrouped, UngroupedImpl, CollectiveBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdist_nccl_start, StartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm_key")
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("redop")
                                  .Attr<ffi::Span<const int64_t>>("perm_src")
                                  .Attr<ffi::Span<const int64_t>>("perm_dst")
                                  .Attr<int64_t>("op_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdist_nccl_wait, WaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("op_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdist_memcpy, MemcpyImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdist_nccl_start_group, StartGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("comm_key")
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("redop")
                                  .Attr<int64_t>("op_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdist_nccl_wait_group, WaitGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("op_id"));
