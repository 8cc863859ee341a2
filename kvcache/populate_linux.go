package kvcache

import "syscall"

// mapPopulate pre-faults a mapping (MmapAllocator.Populate).
const mapPopulate = syscall.MAP_POPULATE
