// A recycling BufferAllocator: the memory of a released batch goes back to a
// free list and the next batch of that size reuses it. One allocation holds
// the buffer and its shared_ptr control block, so a warm loader makes no heap
// calls per batch, and no thread frees memory another thread allocated (the
// glibc slow path that dominated small batches).
//
// Contract: allocate() from any thread; the returned shared_ptr may be copied
// and dropped on any thread. Free lists are moodycamel queues (no mutex).
// Memory ordering: a block handed back is published by the queue's
// enqueue/dequeue (release/acquire inside the queue).
#include "conveyor/detail/buffer_pool.h"

#include <concurrentqueue.h>
#include <oneapi/tbb/scalable_allocator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conveyor/detail/check.h"
#include "conveyor/transfer.h"

namespace conveyor::detail {
namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kMinClassBytes = 64;
constexpr size_t kClasses = 48;         // 64 B .. 2^53 B
constexpr size_t kLargestClassBytes = kMinClassBytes << (kClasses - 1);
constexpr size_t kControlBytes = 64;    // room for libstdc++'s control block

struct PoolState;

// One allocation: this header, then the data at a 64-byte boundary. Pinned
// pools allocate the whole block page-locked and give it a device twin.
struct alignas(kAlignment) Block {
  std::shared_ptr<PoolState> pool;  // set while handed out; empty on a free list
  size_t size_class = 0;
  // Pinned pools: the device buffer of the same capacity (allocated on the
  // first transfer, reused with the block) and the event of its last copy,
  // which must complete before the block is written again. Owned by whoever
  // holds the block's buffer.
  void* device_twin = nullptr;
  TransferEvent last_copy;
  // The work kept on the twin's last copy (DeviceBatch::keep_until), which
  // may still read it after the host buffer came back: the next copy into
  // the twin waits for it, and the twin is freed only after it.
  std::shared_ptr<DeviceCopyUses> last_uses;
  alignas(16) std::byte control[kControlBytes];  // the shared_ptr's control block

  std::byte* data() { return reinterpret_cast<std::byte*>(this) + sizeof(Block); }
  size_t capacity() const { return kMinClassBytes << size_class; }
  static size_t bytes_for(size_t size_class) { return sizeof(Block) + (kMinClassBytes << size_class); }
};
static_assert(sizeof(Block) % kAlignment == 0, "data() must stay 64-byte aligned");

struct PoolState {
  PoolState(size_t cap, std::shared_ptr<TransferDevice> pinned_by)
      : max_free_per_class(cap), device(std::move(pinned_by)) {}
  ~PoolState() {
    for (auto& list : free_lists) {
      Block* block = nullptr;
      while (list.try_dequeue(block)) delete_block(block);
    }
  }

  Block* new_block(size_t size_class) {
    const size_t bytes = Block::bytes_for(size_class);
    void* memory = device ? device->allocate_pinned(bytes)
                          : ::operator new(bytes, std::align_val_t{kAlignment});
    CONVEYOR_CHECK(reinterpret_cast<uintptr_t>(memory) % kAlignment == 0,
                   "pinned memory must be 64-byte aligned");
    Block* block = new (memory) Block;
    block->size_class = size_class;
    return block;
  }

  void delete_block(Block* block) noexcept {
    block->last_copy.synchronize_before_release("a pinned block");  // a copy may still read it
    if (block->last_uses) {
      // Work may still read the twin.
      for (const TransferEvent& use : block->last_uses->events()) use.synchronize_before_release("a device twin");
    }
    if (block->device_twin) device->free_device(block->device_twin);
    block->~Block();
    if (device) {
      device->free_pinned(block);
    } else {
      ::operator delete(static_cast<void*>(block), std::align_val_t{kAlignment});
    }
  }

  const size_t max_free_per_class;
  const std::shared_ptr<TransferDevice> device;  // pinned pools only
  std::array<moodycamel::ConcurrentQueue<Block*>, kClasses> free_lists;
  // Approximate sizes of the free lists. Relaxed: only bounds the cache.
  std::array<std::atomic<size_t>, kClasses> free_counts{};
  // Bytes handed out and not yet back, the most there ever were, and bytes
  // idle on the free lists: the pool keeps idle no more than the loader ever
  // had in use at once, whatever the spread of sizes. Relaxed: bounds only
  // (concurrent returns may overshoot by a block each).
  std::atomic<size_t> in_use_bytes{0};
  std::atomic<size_t> peak_in_use_bytes{0};
  std::atomic<size_t> idle_bytes{0};

  void note_handed_out(size_t bytes) {
    const size_t now = in_use_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    size_t peak = peak_in_use_bytes.load(std::memory_order_relaxed);
    while (now > peak && !peak_in_use_bytes.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
};


void recycle(Block* block) noexcept {
  std::shared_ptr<PoolState> pool = std::move(block->pool);
  CONVEYOR_CHECK(pool != nullptr, "a pool block without its pool");
  // Not written again before the device has read it (the consumer normally
  // waited on the event long ago: this returns at once).
  block->last_copy.synchronize_before_release("a pinned block");
  block->last_copy = TransferEvent();
  const size_t c = block->size_class;
  const size_t bytes = block->capacity();
  pool->in_use_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  const size_t idle = pool->idle_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (idle <= pool->peak_in_use_bytes.load(std::memory_order_relaxed)) {
    if (pool->free_counts[c].fetch_add(1, std::memory_order_relaxed) < pool->max_free_per_class &&
        pool->free_lists[c].enqueue(block)) {
      return;
    }
    pool->free_counts[c].fetch_sub(1, std::memory_order_relaxed);
  }
  pool->idle_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  pool->delete_block(block);
}

// Places the control block inside the Block and hands the Block back to the
// pool when the control block goes, which is the last thing a shared_ptr
// frees (after the deleter), so no one can still touch the memory.
template <class T>
struct InBlockAllocator {
  using value_type = T;
  Block* block;
  explicit InBlockAllocator(Block* b) noexcept : block(b) {}
  template <class U>
  InBlockAllocator(const InBlockAllocator<U>& other) noexcept : block(other.block) {}
  T* allocate(size_t n) {
    static_assert(sizeof(T) <= kControlBytes, "the control block does not fit in the Block");
    static_assert(alignof(T) <= 16, "the control block needs more alignment");
    CONVEYOR_CHECK(n == 1, "a control block is one object");
    return reinterpret_cast<T*>(block->control);
  }
  void deallocate(T*, size_t) noexcept { recycle(block); }
  template <class U>
  bool operator==(const InBlockAllocator<U>& other) const noexcept {
    return block == other.block;
  }
};

// The deleter of a pool buffer's shared_ptr: does nothing (the Block is
// recycled when the control block goes), but names the Block, so that
// std::get_deleter identifies pool memory (see pool_block_of()).
struct BlockTag {
  Block* block;
  void operator()(std::byte*) const noexcept {}
};

// A std::bad_alloc, as any allocation beyond memory (decoders and crops
// turn those into their own errors), that names the size.
class BeyondEveryClass final : public std::bad_alloc {
 public:
  explicit BeyondEveryClass(size_t bytes)
      : message_("cannot allocate a batch buffer of " + std::to_string(bytes) + " bytes: the pool's largest is " +
                 std::to_string(kLargestClassBytes)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

class RecyclingAllocator final : public BufferAllocator {
 public:
  RecyclingAllocator(size_t max_free_per_class, std::shared_ptr<TransferDevice> pinned_by)
      : state_(std::make_shared<PoolState>(max_free_per_class, std::move(pinned_by))) {}

  PoolStats stats() const {
    return {state_->idle_bytes.load(std::memory_order_relaxed),
            state_->in_use_bytes.load(std::memory_order_relaxed),
            state_->peak_in_use_bytes.load(std::memory_order_relaxed)};
  }

  std::shared_ptr<std::byte> allocate(size_t bytes) override {
    // A size from user code (a collate's shape): an error to catch, not a
    // broken invariant. Checked before the rounding, which would wrap.
    if (bytes > kLargestClassBytes) throw BeyondEveryClass(bytes);
    const size_t units = (std::max(bytes, kMinClassBytes) + kMinClassBytes - 1) / kMinClassBytes;
    const auto size_class = static_cast<size_t>(std::bit_width(units - 1));
    Block* block = nullptr;
    if (state_->free_lists[size_class].try_dequeue(block)) {
      state_->free_counts[size_class].fetch_sub(1, std::memory_order_relaxed);
      state_->idle_bytes.fetch_sub(block->capacity(), std::memory_order_relaxed);
    } else {
      block = state_->new_block(size_class);
    }
    state_->note_handed_out(block->capacity());
    block->pool = state_;
    return std::shared_ptr<std::byte>(block->data(), BlockTag{block}, InBlockAllocator<std::byte>(block));
  }

 private:
  std::shared_ptr<PoolState> state_;
};

}  // namespace

namespace {

// Named, so that std::get_deleter tells its buffers (is_scalable_heap_buffer).
struct ScalableFree {
  void operator()(std::byte* block) const noexcept { scalable_aligned_free(block); }
};

// oneTBB's scalable allocator: per-thread heaps that take back a block freed
// by another thread through a lock-free list, so memory made on a worker and
// freed on the consumer's thread costs no arena lock (glibc's does).
class ScalableHeap final : public BufferAllocator {
 public:
  std::shared_ptr<std::byte> allocate(size_t bytes) override {
    void* memory = scalable_aligned_malloc(std::max<size_t>(bytes, 1), 64);
    if (memory == nullptr) throw std::bad_alloc();
    // The control block from the same heap: it too is freed on another thread.
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(memory), ScalableFree{},
                                      tbb::scalable_allocator<std::byte>());
  }
};

// What a loader's batch task makes outside collate: samples and their
// transforms' outputs, mostly freed by the same worker once collated. Small
// ones from glibc, whose per-thread arenas serve them fastest; large ones
// from oneTBB, which keeps freed large blocks for the next batch where glibc
// gives each back to the kernel (munmap, or trimming the arena's top) and
// the next batch page-faults it in again.
class SampleHeap final : public BufferAllocator {
 public:
  // The loader that owned this heap is gone: oneTBB's cached large blocks go
  // back to the kernel, as glibc gave back each one it freed (a loader of
  // 192 KiB samples on 2 workers left 25 MiB resident otherwise). Blocks
  // still held elsewhere stay; the cache refills as any user allocates.
  ~SampleHeap() override {
    if (served_large_.load(std::memory_order_relaxed)) {
      scalable_allocation_command(TBBMALLOC_CLEAN_ALL_BUFFERS, nullptr);
    }
  }

  std::shared_ptr<std::byte> allocate(size_t bytes) override {
    if (bytes < kLargeSampleBytes) return allocate_heap_buffer(bytes);
    // Relaxed: read only by the destructor, which runs after every task (the
    // heap goes with the loader's core, which outlives its tasks). Written
    // once, so the workers do not bounce its cache line.
    if (!served_large_.load(std::memory_order_relaxed)) served_large_.store(true, std::memory_order_relaxed);
    return large_.allocate(bytes);
  }

 private:
  ScalableHeap large_;
  std::atomic<bool> served_large_{false};
};

}  // namespace

std::shared_ptr<BufferAllocator> make_scalable_heap() { return std::make_shared<ScalableHeap>(); }

std::shared_ptr<BufferAllocator> make_sample_heap() { return std::make_shared<SampleHeap>(); }

std::shared_ptr<BufferAllocator> make_recycling_allocator(size_t max_free_per_class) {
  return std::make_shared<RecyclingAllocator>(max_free_per_class, nullptr);
}

std::shared_ptr<BufferAllocator> make_pinned_allocator(std::shared_ptr<TransferDevice> device,
                                                       size_t max_free_per_class) {
  CONVEYOR_CHECK(device != nullptr, "a pinned pool needs a device");
  return std::make_shared<RecyclingAllocator>(max_free_per_class, std::move(device));
}

PoolStats pool_stats(const BufferAllocator& pool) {
  const auto* recycling = dynamic_cast<const RecyclingAllocator*>(&pool);
  CONVEYOR_CHECK(recycling != nullptr, "pool_stats of an allocator that is not a pool");
  return recycling->stats();
}

void hold_forever(std::shared_ptr<void> memory) noexcept {
  static std::mutex mutex;
  static auto* held = new std::vector<std::shared_ptr<void>>();  // never destroyed: a copy may outlive main()
  std::lock_guard lock(mutex);
  try {
    held->push_back(std::move(memory));
  } catch (...) {
    new (std::nothrow) std::shared_ptr<void>(std::move(memory));  // leaked instead
  }
}

bool is_pool_buffer(const std::shared_ptr<void>& owner) {
  return std::get_deleter<BlockTag>(owner) != nullptr;
}

bool is_scalable_heap_buffer(const std::shared_ptr<void>& owner) {
  return std::get_deleter<ScalableFree>(owner) != nullptr;
}

std::optional<DeviceTwin> device_twin_of(const std::shared_ptr<void>& owner) {
  const BlockTag* tag = std::get_deleter<BlockTag>(owner);
  if (tag == nullptr) return std::nullopt;
  Block* block = tag->block;
  if (!block->pool || !block->pool->device) return std::nullopt;  // a heap pool
  if (block->device_twin == nullptr) block->device_twin = block->pool->device->allocate_device(block->capacity());
  return DeviceTwin{block->data(), block->device_twin, block->capacity(), &block->last_copy, &block->last_uses};
}

}  // namespace conveyor::detail
