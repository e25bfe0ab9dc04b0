// Skips a test, with a message, where no CUDA device is visible (CI).
#pragma once

#include <gtest/gtest.h>

#include <conveyor/cuda.h>

#define REQUIRE_CUDA_DEVICE()                                                                       \
  if (conveyor::cuda::device_count() == 0) {                                                        \
    GTEST_SKIP() << "no CUDA device here (cudaGetDeviceCount reports none); runs on a GPU machine"; \
  }
