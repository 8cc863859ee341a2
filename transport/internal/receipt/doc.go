// Package receipt is the receiving half that the tcp and shm backends share:
// the receipts a Transport has armed (its transport.Recv values), by tag.
//
// It owns a receipt's bookkeeping from Expect to its end: the random tag
// and the descriptor that names it (endpoint, tag, total; Format), the
// table that finds it by the tag a sender quotes, the walk from an offset
// of the receipt to the piece of dst that holds it, and its end: Done
// closes, with Err set, only once the receipt has ended and no writer holds
// dst any more, which is what Cancel waits for. Outcome alone, Done and Err
// of something that ends once, also serves ucx.
//
// It owns no goroutine and reads no connection: a backend looks a receipt up
// under its tag, holds it while its goroutine writes into dst, releases it,
// and finishes it (with nil once every byte is in place). A Table has no
// lock of its own: it is guarded by the lock of the Transport that owns it
// (Config.Lock), so that a backend can bind a receipt to a connection, or
// interrupt the reader writing into it, in the same critical section as it
// looks the receipt up or finishes it. Methods whose name ends in Locked
// need that lock held; the others take it.
//
// The tcp and ucx backends, and the one the transceiver runs for its control
// plane, are not alike enough for more: what a sender, a frame or an op is
// stays in each backend.
package receipt
