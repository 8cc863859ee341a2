package transceiver

import "github.com/kvxfer/kvxfer/layout"

// Direct transfers skip the staging buffers: the sender gathers its part of
// each block straight from pool memory and the receiver scatters it straight
// into its blocks, with vectored I/O. It applies to identical layouts (one
// whole-block span per block: TensorRT-LLM's zero-copy) and, beyond what
// TensorRT-LLM does, to any pairing whose spans are large enough that
// per-segment costs stay small (context TP2 → generation TP1 of a Llama
// shape: one 4 MiB block in, 64 spans of 32 KiB out). Smaller spans go
// through the staging buffers in chunks. Both sides decide with the same
// function of the same plan, so they always agree.

// minDirectSpan is the smallest average span, in bytes, for which direct
// transfers beat pack + send + unpack.
const minDirectSpan = 16 << 10

// maxDirectSegments bounds the segment list of one direct transfer.
const maxDirectSegments = 1 << 20

// directOK reports whether a pair with plan p may move n blocks directly.
func directOK(p *layout.Plan, n int) bool {
	if p.Identity() {
		return true
	}
	packed := p.PackedBytesPerBlock()
	src, dst := len(p.SrcSpans()), len(p.DstSpans())
	if packed == 0 || src == 0 || dst == 0 || n*max(src, dst) > maxDirectSegments {
		return false
	}
	return packed/int64(src) >= minDirectSpan && packed/int64(dst) >= minDirectSpan
}

// gatherOK reports whether the sender of a staged transfer with plan p, in
// chunks of n blocks, sends each chunk gathered from its blocks' spans
// rather than packed into a staging buffer (mover.Pair.Gather): the
// sender's own spans large enough, whatever the receiver's. The receiver
// gets the same bytes either way, so this is the sender's choice alone;
// it also leaves a receiver that stops reading no shared buffer to hold.
func gatherOK(p *layout.Plan, n int) bool {
	if p.Identity() {
		return true
	}
	packed, src := p.PackedBytesPerBlock(), len(p.SrcSpans())
	return packed > 0 && src > 0 && n*src <= maxDirectSegments && packed/int64(src) >= minDirectSpan
}
