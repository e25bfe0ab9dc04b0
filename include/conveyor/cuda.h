// conveyor/cuda.h: CUDA as the transfer stage's device (target conveyor::cuda).
//
// Uses the CUDA runtime only (no kernels): a pinned pool from cudaHostAlloc,
// one non-default copy stream per device object, device buffers from
// cudaMalloc, and pooled events (one per batch). Chosen at run time: without
// a driver or a device, select_transfer_device() warns once and returns
// nullptr (pin_memory then is a no-op, as in PyTorch) or the host stand-in.
#pragma once

#include <memory>
#include <string>

#include "conveyor/errors.h"
#include "conveyor/transfer.h"

namespace conveyor::cuda {

// A failed CUDA runtime call: which call, where, and cudaGetErrorString.
class CudaError : public RuntimeError {
 public:
  CudaError(const std::string& what, int code) : RuntimeError(what), code_(code) {}
  int code() const noexcept { return code_; }  // the cudaError_t

 private:
  int code_;
};

// CUDA devices visible to this process; 0 when the driver or runtime is
// missing or too old (never throws).
int device_count() noexcept;

// Device `index` for the transfer stage. Throws CudaError.
std::shared_ptr<TransferDevice> make_device(int index = 0);

// An event completing once the work queued so far on `stream` (a
// cudaStream_t of the current device; nullptr: the legacy default stream)
// has, for DeviceBatch::keep_until:
//
//   cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(copy.ready.native()), 0);
//   ... kernels on `stream` read copy.buffers ...
//   copy.keep_until(conveyor::cuda::record_event(stream));
//
// Throws CudaError.
TransferEvent record_event(void* stream);

// make_device(index) when a CUDA device is there. Otherwise one warning and
// the host stand-in if `standin_fallback`, else nullptr.
std::shared_ptr<TransferDevice> select_transfer_device(int index = 0, bool standin_fallback = false);

}  // namespace conveyor::cuda
