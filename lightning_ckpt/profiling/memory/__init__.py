"""Memory: live bytes counted by storage, their lifetimes, the static and sharded state, the allocator and the real peak."""
