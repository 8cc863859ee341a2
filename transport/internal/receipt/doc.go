// Package receipt is the receiving half that the tcp and shm backends share:
// the receipts a Transport has armed (its transport.Recv values), by tag.
//
// It owns a receipt's bookkeeping from Expect to its end: the random tag
// and the descriptor that names it (endpoint, tag, total; Format), the
// table that finds it by the tag a sender quotes, the walk from an offset
// of the receipt to the piece of dst that holds it (Pieces, which tcp's
// Send uses for its src too), and its end: Done closes, with Err set, only
// once the receipt has ended and no writer holds dst any more, which is
// what Cancel waits for.
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
// What a sender, a frame or an op is stays in each backend. ucx, whose
// receipts belong to its progress goroutine rather than to a lock, and whose
// tags and descriptors are UCX's, shares only Outcome.
package receipt
