package ucx

// Which part of a registered region is backed by huge pages (pure Go,
// without the build tag, so that it is tested in every build).

// hugePage is the size of a transparent huge page on the machines UCX
// runs on (x86-64, and arm64 with 4 KiB base pages).
const hugePage = 2 << 20

// hugeInterior returns the part of the region [addr, addr+n) that whole,
// aligned huge pages cover: its start rounded up and its end rounded down
// to hugePage. ok is false when no whole huge page fits. Advice given to
// that part never touches memory outside the region.
func hugeInterior(addr, n uintptr) (start, length uintptr, ok bool) {
	end := addr + n
	if end < addr { // wraps: not a region
		return 0, 0, false
	}
	start = (addr + hugePage - 1) &^ (hugePage - 1)
	if start < addr { // rounding up wrapped
		return 0, 0, false
	}
	stop := end &^ (hugePage - 1)
	if stop <= start {
		return 0, 0, false
	}
	return start, stop - start, true
}
