package transceiver

import "github.com/kvxfer/kvxfer/layout"

// Direct transfers skip the staging buffers: the sender gathers its part of
// each block straight from pool memory and the receiver scatters it straight
// into its blocks, with vectored I/O. It applies to identical layouts (one
// whole-block span per block: TensorRT-LLM's zero-copy) and, beyond what
// TensorRT-LLM does, to any pairing whose spans are large enough that
// per-segment costs stay small (context TP2 → generation TP1 of a Llama
// shape: one 4 MiB block in, 64 spans of 32 KiB out). Smaller spans go
// in chunks, and each side stages only where its own spans are small: a
// sender with large spans gathers its chunks from its blocks (gatherOK), a
// receiver with large spans scatters them into its blocks (scatterOK),
// the other packs into, or unpacks from, its staging buffers. Both sides
// decide direct or chunked with the same function of the same plan, so
// they always agree; the chunks' bytes are the same whoever stages.

// minDirectSpan is the smallest average span, in bytes, for which direct
// transfers beat pack + send + unpack.
const minDirectSpan = 16 << 10

// maxDirectSegments bounds the segment list of one direct transfer.
const maxDirectSegments = 1 << 20

// directOK reports whether a pair with plan p may move n blocks directly.
func directOK(p *layout.Plan, n int) bool {
	return p.Identity() || (spansOK(p, p.SrcSpans(), n) && spansOK(p, p.DstSpans(), n))
}

// gatherOK reports whether the sender of a staged transfer with plan p, in
// chunks of n blocks, sends each chunk gathered from its blocks' spans
// rather than packed into a staging buffer (mover.Pair.Gather): the
// sender's own spans large enough, whatever the receiver's. The receiver
// gets the same bytes either way, so this is the sender's choice alone;
// it also leaves a receiver that stops reading no shared buffer to hold.
func gatherOK(p *layout.Plan, n int) bool { return p.Identity() || spansOK(p, p.SrcSpans(), n) }

// scatterOK is gatherOK's mirror for the receiver (mover.Pair.Scatter):
// each chunk's receipt is armed straight into its blocks' spans when the
// receiver's own spans are large enough, whatever the sender's.
func scatterOK(p *layout.Plan, n int) bool { return p.Identity() || spansOK(p, p.DstSpans(), n) }

// spansOK reports whether one side's spans of p average at least
// minDirectSpan and n blocks of them make at most maxDirectSegments.
func spansOK(p *layout.Plan, spans []layout.Span, n int) bool {
	packed := p.PackedBytesPerBlock()
	return packed > 0 && len(spans) > 0 && n*len(spans) <= maxDirectSegments && packed/int64(len(spans)) >= minDirectSpan
}
