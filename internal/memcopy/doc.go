// Package memcopy copies memory whose destination will not be read again
// soon: the packing and unpacking of a request's KV blocks, and the copies
// of the shm data plane into a receiver's pool.
//
// A plain copy() of a few KiB at a time (a span of a block) writes through
// the caches: every destination line is first read from memory (a read for
// ownership) and later written back, so the bus carries three bytes for
// each byte copied. Go's runtime uses non-temporal stores only for single
// copies of a megabyte or more, which a copy per span never is. Stream
// writes with non-temporal stores whatever the length, so a copy made of
// many short spans moves at the speed of one long copy.
//
// A copy made of many short spans pays a second cost: each span's first
// lines miss while the hardware prefetcher, which stops at page
// boundaries, trains on the new stream. StreamSpan copies one span and
// prefetches a few KiB ahead, across into the next one, while it does; an
// operation calls it per span and Fence once at the end (Stream is one
// StreamSpan and its Fence). On amd64 the copies are assembly: 32-byte
// (AVX) stores where the processor has AVX, 16-byte (SSE2) ones otherwise.
//
// Use them only when the whole operation moves far more than the caches
// hold (StreamMin): data they write is not in any cache afterwards, so a
// reader that follows at once pays a miss per line.
package memcopy

// StreamMin is the size of a whole operation (the sum of its copies) from
// which callers should use Stream rather than copy: about what the caches
// of one core hold, and what the Go runtime's own copy uses as its bound
// for non-temporal stores.
const StreamMin = 1 << 20
