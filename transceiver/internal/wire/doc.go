// Package wire is the transceiver's control-plane protocol: versioned,
// length-prefixed frames over a TCP connection between a generation rank
// (which dials) and a context rank (which listens).
//
// A frame is a 4-byte little-endian length n (of what follows, at most
// MaxFrame), one type byte and n-1 bytes of payload. Payload fields are
// uvarints, fixed-size little-endian integers, and length-prefixed byte
// strings, each bounded before anything is allocated. A decoder error names
// the frame type, the field and the byte offset.
//
// Conversation (the generation side pulls):
//
//	gen → ctx  Hello{version, rank, instance CacheState, host, backends}
//	ctx → gen  Hello (same fields for the context rank), or Refused and close
//	gen → ctx  RequestInfo{ctx request id, token, gen CacheState, gen rank, blocks, ...}
//	ctx → gen  Ready{chunk blocks} once every generation rank that needs this
//	           context rank has asked; or Refused{reason}
//	gen → ctx  ChunkDesc{index, backend descriptor} for each chunk, as receive
//	           buffers free up; the context rank then sends that chunk on the
//	           data plane
//	either     Abort{reason}: the transfer is over and failed
//	either     Ping / Pong: liveness
//
// Package wire knows the frames, not what they mean; the transceiver does.
package wire
