package hugepage

import (
	"log/slog"
	"sync/atomic"
)

// Size is the size of a transparent huge page on the machines kvxfer runs
// on (x86-64, and arm64 with 4 KiB base pages).
const Size = 2 << 20

// Interior returns the part of the region [addr, addr+n) that whole,
// aligned huge pages cover: its start rounded up and its end rounded down
// to Size. ok is false when no whole huge page fits. Advice given to that
// part never touches memory outside the region.
func Interior(addr, n uintptr) (start, length uintptr, ok bool) {
	end := addr + n
	if end < addr { // wraps: not a region
		return 0, 0, false
	}
	start = (addr + Size - 1) &^ (Size - 1)
	if start < addr { // rounding up wrapped
		return 0, 0, false
	}
	stop := end &^ (Size - 1)
	if stop <= start {
		return 0, 0, false
	}
	return start, stop - start, true
}

// Report is what Advise did to a region.
type Report struct {
	// Bytes is the length of the interior that was advised: 0 when no
	// whole huge page fits in the region (nothing was advised).
	Bytes uintptr
	// Collapse is MADV_COLLAPSE's error, nil when it succeeded: the
	// pages already there then stay small (those first touched later
	// still come huge). A kernel before 6.1 refuses it with EINVAL.
	Collapse error
}

// AdviseLogged is Advise for a transport's RegisterMemory, which never
// fails on it (huge pages only make copies faster): a refusal is logged at
// Info the first time *logged is still false (then set), with why small
// pages matter to the transport appended (", which …"; may be empty);
// pages that stay small and the bytes advised are logged at Debug. who
// names the transport in the messages.
func AdviseLogged(mem []byte, log *slog.Logger, who, why string, logged *atomic.Bool) {
	rep, err := Advise(mem)
	switch {
	case err != nil:
		if logged.CompareAndSwap(false, true) {
			log.Info(who+": registered memory stays in small pages"+why, "err", err)
		}
	case rep.Collapse != nil:
		log.Debug(who+": registered memory: pages already there stay small (first touches come huge)", "err", rep.Collapse)
	case rep.Bytes > 0:
		log.Debug(who+": registered memory advised to huge pages", "bytes", rep.Bytes)
	}
}
