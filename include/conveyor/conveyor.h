// conveyor/conveyor.h: everything in conveyor::core. LibTorch adapters are
// in conveyor/torch.h (target conveyor::torch).
#pragma once

#include "conveyor/array.h"
#include "conveyor/buffer.h"
#include "conveyor/collate.h"
#include "conveyor/data_error.h"
#include "conveyor/data_loader.h"
#include "conveyor/dataset.h"
#include "conveyor/datasets.h"
#include "conveyor/errors.h"
#include "conveyor/generator.h"
#include "conveyor/metrics.h"
#include "conveyor/options.h"
#include "conveyor/sampler.h"
#include "conveyor/transfer.h"
#include "conveyor/version.h"
#include "conveyor/warnings.h"
#include "conveyor/worker_info.h"
