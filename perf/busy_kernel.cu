// A kernel that keeps the GPU busy for a controllable time: the "compute"
// the transfer stage's copies should hide under.
#include <cuda_runtime.h>

namespace {
__global__ void busy(float* data, int n, int rounds) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = data[i];
  for (int r = 0; r < rounds; ++r) x = x * 0.999f + 0.001f;
  data[i] = x;
}
}  // namespace

extern "C" cudaError_t conveyor_launch_busy_kernel(float* data, int n, int rounds, cudaStream_t stream) {
  busy<<<(n + 255) / 256, 256, 0, stream>>>(data, n, rounds);
  return cudaGetLastError();
}
