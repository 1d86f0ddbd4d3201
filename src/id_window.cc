#include "id_window.h"

namespace laminar::internal {

IdWindow::IdWindow(std::size_t capacity) : capacity_(capacity), blocks_(16) {}

std::size_t IdWindow::home(std::uint64_t run) const {
  std::uint64_t x = run;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return std::size_t(x) & mask();
}

std::size_t IdWindow::probe(std::uint64_t run) const {
  std::size_t i = home(run);
  while (blocks_[i].run != run && blocks_[i].run != kEmpty) i = (i + 1) & mask();
  return i;
}

const IdWindow::Block* IdWindow::find(std::uint64_t id) const {
  const Block& b = blocks_[probe(id / kBlockIds)];
  return b.run == id / kBlockIds ? &b : nullptr;
}

IdWindow::Block& IdWindow::block_for(std::uint64_t id) {
  const std::uint64_t run = id / kBlockIds;
  std::size_t i = probe(run);
  if (blocks_[i].run == run) return blocks_[i];
  if (2 * (used_ + 1) > blocks_.size()) {
    grow();
    i = probe(run);
  }
  ++used_;
  blocks_[i] = Block{run, 0, 0};
  return blocks_[i];
}

bool IdWindow::admit(std::uint64_t id) {
  Block& b = block_for(id);
  const std::uint64_t bit = bit_of(id);
  if ((b.live | b.retired) & bit) return false;
  b.live |= bit;
  return true;
}

void IdWindow::set_live(std::uint64_t id) { block_for(id).live |= bit_of(id); }

void IdWindow::retire(std::uint64_t id) {
  Block& b = block_for(id);
  const std::uint64_t bit = bit_of(id);
  b.live &= ~bit;
  if (b.retired & bit) return;
  b.retired |= bit;
  if (ring_.size() < capacity_) {
    ring_.push_back(id);
    return;
  }
  const std::uint64_t oldest = ring_[next_];
  ring_[next_] = id;
  if (++next_ == ring_.size()) next_ = 0;
  clear_bits(oldest, &Block::retired);
}

bool IdWindow::contains(std::uint64_t id) const {
  const Block* b = find(id);
  return b != nullptr && ((b->live | b->retired) & bit_of(id)) != 0;
}

bool IdWindow::retired(std::uint64_t id) const {
  const Block* b = find(id);
  return b != nullptr && (b->retired & bit_of(id)) != 0;
}

void IdWindow::clear_bits(std::uint64_t id, std::uint64_t Block::*bits) {
  const std::size_t i = probe(id / kBlockIds);
  Block& b = blocks_[i];
  if (b.run != id / kBlockIds) return;
  b.*bits &= ~bit_of(id);
  if ((b.live | b.retired) == 0) remove_at(i);
}

// Empties slot `i`, moving later blocks of its probe run back so that every block stays reachable
// from its home (linear probing without tombstones).
void IdWindow::remove_at(std::size_t i) {
  for (std::size_t j = (i + 1) & mask(); blocks_[j].run != kEmpty; j = (j + 1) & mask()) {
    const std::size_t k = home(blocks_[j].run);
    // The block at j may move to i unless its home lies cyclically in (i, j].
    const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
    if (stays) continue;
    blocks_[i] = blocks_[j];
    i = j;
  }
  blocks_[i] = Block{};
  --used_;
}

void IdWindow::grow() {
  std::vector<Block> old(2 * blocks_.size());
  old.swap(blocks_);
  for (const Block& b : old) {
    if (b.run != kEmpty) blocks_[probe(b.run)] = b;
  }
}

}  // namespace laminar::internal
