// Package mover moves the bytes of one pair of ranks of a transfer over a
// data plane (transport.Transport), as the transceiver's protocol core
// planned them: directly, gathered from the sender's blocks and scattered
// into the receiver's with vectored I/O, or staged, chunk by chunk
// through a bounded set of staging buffers (Buffers), packed (or gathered
// from the blocks' spans, Pair.Gather) on the sending side and unpacked on
// the receiving side with a layout.Plan. The buffers are shared by a
// rank's requests; a transfer that holds one past its limit while another
// waits is stopped (HoldLimit).
//
// A Pair is a value; its Send and Receive run on the caller's goroutine
// and end when every byte has moved, at the first error, or when their
// context ends (its cause). They never keep a buffer past their return:
// what they took is put back, what they armed is cancelled. The control
// frames around the bytes are the caller's: a staged receive tells the
// sender where each chunk goes through the announce function it is given,
// and a staged send reads those announcements from a channel.
package mover
