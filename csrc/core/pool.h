// Shared-memory host pool: num_slots x slot_bytes in one POSIX shared-memory
// mapping, so the scheduler process (tiers) and the GPU worker processes
// (device copies) see the same bytes without copying. Behind the slots, one
// fence word per slot (fence.h) in the same mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fence.h"

namespace kvtier {

struct PoolOptions {
  bool mlock = false;     // page-lock (fails with IoError when RLIMIT_MEMLOCK is too low)
  bool prefault = true;   // MADV_POPULATE_WRITE, else touch a byte per page
  bool hugepages = true;  // MADV_HUGEPAGE (advisory)
};

class HostPool {
 public:
  // Creates a new named region; name may be empty (a unique one is chosen).
  // The creator unlinks the name on close.
  static HostPool create(std::size_t num_slots, std::size_t slot_bytes, std::string name,
                         PoolOptions opts = {});
  // Maps an existing region by name, validating its header. A non-zero
  // view_slot_bytes sees its data area as slots of that size instead (as
  // many as fit): the node's block sizes share one region that way, each
  // engine addressing the slots of its own size. A view has no fences.
  static HostPool attach(const std::string& name, std::size_t view_slot_bytes = 0);
  // Unlinks the names of kvtier pools whose creating process is gone (same
  // pid namespace only); processes still mapping them keep their memory.
  // Called by create(). Returns how many names it removed.
  static std::size_t reap_stale() noexcept;

  HostPool(HostPool&& other) noexcept;
  HostPool& operator=(HostPool&& other) noexcept;
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;
  ~HostPool();

  // Removes the name (creator) and refuses further use; the mapping itself
  // stays until destruction so that views handed out earlier stay valid.
  void close() noexcept;
  bool closed() const noexcept { return closed_; }
  // Keeps the name past close and destruction: the node's pools outlive the
  // node, so engines that map them go on when a new node adopts them.
  void disown() noexcept { owner_ = false; }

  const std::string& name() const noexcept { return name_; }
  std::size_t num_slots() const noexcept { return num_slots_; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  std::size_t data_bytes() const noexcept { return num_slots_ * slot_bytes_; }
  // A view's slots are not the region's (attach's view_slot_bytes).
  bool view() const noexcept { return view_; }
  bool owner() const noexcept { return owner_; }
  bool locked() const noexcept { return locked_; }

  // Enters [offset, offset + n) of the mapping (header, slots, fences) in
  // this process's page tables without writing a byte, as a GPU worker's
  // cudaHostRegister does: a copy then pays no first-touch page fault.
  // Clamped to the mapping, offset rounded down to a page; returns the bytes
  // entered (0 when the kernel refused, e.g. /dev/shm short of pages: the
  // copy that touches them says so). Safe beside copies into the same pages.
  std::size_t populate(std::size_t offset, std::size_t n) const noexcept;
  std::size_t map_bytes() const noexcept { return map_bytes_; }

  // Throws InvalidArgument for a slot out of range or a closed pool.
  std::uint8_t* slot(std::size_t index) const;
  std::uint8_t* data() const;
  // True when [addr, addr+n) lies inside the data area.
  bool contains(std::uintptr_t addr, std::size_t n) const noexcept;
  // The fence words, one per slot (whole pages, behind the data area).
  fence::Word* fence(std::size_t index) const;
  std::uint8_t* fence_area() const;
  std::size_t fence_bytes() const noexcept { return fence_bytes_for(fence_slots_); }
  static std::size_t fence_bytes_for(std::size_t num_slots) noexcept {
    return (num_slots * sizeof(fence::Word) + kDataOffset - 1) / kDataOffset * kDataOffset;
  }

  // Alignment of the data area and of each slot when slot_bytes is a multiple
  // of it; O_DIRECT needs 4 KiB.
  static constexpr std::size_t kDataOffset = 4096;

 private:
  HostPool() = default;
  void map(int fd, std::size_t total);
  void unmap() noexcept;

  std::string name_;
  std::uint8_t* base_ = nullptr;
  std::size_t map_bytes_ = 0;
  std::size_t num_slots_ = 0;
  std::size_t slot_bytes_ = 0;
  std::size_t region_bytes_ = 0;  // the data area as created (header's slots x bytes)
  std::size_t fence_slots_ = 0;   // fence words behind it: the header's slots
  bool view_ = false;
  bool owner_ = false;
  bool locked_ = false;
  bool closed_ = false;
};

}  // namespace kvtier
