package receipt

import "github.com/kvxfer/kvxfer/internal/memcopy"

// Pieces is buffers addressed as one run of bytes, in order: the dst of a
// receipt, the src of a Send.
type Pieces struct {
	bufs [][]byte
	ends []int64 // ends[i]: offset just past bufs[i]
}

// MakePieces returns bufs as Pieces, and their total length.
func MakePieces(bufs [][]byte) (Pieces, int64) {
	ends := make([]int64, len(bufs))
	var total int64
	for i, b := range bufs {
		total += int64(len(b))
		ends[i] = total
	}
	return Pieces{bufs: bufs, ends: ends}, total
}

// Slice returns the bytes at offset off: the rest of the buffer that holds
// off, at most n bytes, never empty. 0 <= off < total, n > 0.
func (p Pieces) Slice(off, n int64) []byte {
	i := p.at(off)
	b := p.bufs[i][off-(p.ends[i]-int64(len(p.bufs[i]))):]
	if int64(len(b)) > n {
		b = b[:n]
	}
	return b
}

// Append appends the slices of the buffers that hold [off, off+n) to vec,
// leaving empty buffers out, and returns it.
func (p Pieces) Append(vec [][]byte, off, n int64) [][]byte {
	for i := p.at(off); n > 0; i++ {
		b := p.bufs[i][off-(p.ends[i]-int64(len(p.bufs[i]))):]
		if int64(len(b)) > n {
			b = b[:n]
		}
		if len(b) > 0 {
			vec = append(vec, b)
		}
		off += int64(len(b))
		n -= int64(len(b))
	}
	return vec
}

// CopyAt copies src into the pieces from offset off on; it must fit.
// Into pieces that add up to memcopy.StreamMin or more (a request's
// blocks, which nobody reads until the receive ends), a copy shorter than
// that is made with non-temporal stores, as layout's Unpack does: a
// receive that scatters into many short spans then moves about as fast as
// one into a single buffer.
func (p Pieces) CopyAt(off int64, src []byte) {
	stream := len(p.ends) > 0 && p.ends[len(p.ends)-1] >= memcopy.StreamMin
	for i := p.at(off); len(src) > 0; i++ {
		dst := p.bufs[i][off-(p.ends[i]-int64(len(p.bufs[i]))):]
		var k int
		if stream && min(len(dst), len(src)) < memcopy.StreamMin {
			k = memcopy.Stream(dst, src)
		} else {
			k = copy(dst, src)
		}
		src = src[k:]
		off += int64(k)
	}
}

// at returns the index of the buffer that holds offset off: the first i
// with ends[i] > off (an empty buffer holds nothing).
func (p Pieces) at(off int64) int {
	lo, hi := 0, len(p.ends)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if p.ends[m] > off {
			hi = m
		} else {
			lo = m + 1
		}
	}
	return lo
}
