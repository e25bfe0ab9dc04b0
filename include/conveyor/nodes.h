// conveyor/nodes.h: the pipeline graph's nodes (conveyor/node.h has the
// contract). Sources, transforms, grouping, shuffling, repetition, merging,
// the transfer to a device.
#pragma once

#include "conveyor/node.h"
#include "conveyor/nodes/batch.h"
#include "conveyor/nodes/combine.h"
#include "conveyor/nodes/map.h"
#include "conveyor/nodes/parallel.h"
#include "conveyor/nodes/repeat.h"
#include "conveyor/nodes/shard.h"
#include "conveyor/nodes/shuffle.h"
#include "conveyor/nodes/sources.h"
#include "conveyor/nodes/transfer.h"
