package bench

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
)

// BaselineUCXC is the UCX baseline on memory both sides have written: a C
// UCP program's tag-matching bandwidth between two processes, compared,
// like ucx_perftest, with runs that backend ucx carried.
const BaselineUCXC = "ucx_c"

// ucxBWSource is the C program of the ucx_c baseline (csrc/ucxbw.c, which
// says what it does), built with cc against libucx at bench time.
//
// ucx_perftest cannot stand in for it: its buffers come from ucp_mem_map,
// System V shared memory in 4 KiB pages on a host with shared memory, and
// with UCX_ALLOC_PRIO=thp it gets huge pages that it never writes, so it
// reads the kernel's huge zero page, which stays in the CPU's caches. The
// backend's pools are written memory on transparent huge pages.
//
//go:embed csrc/ucxbw.c
var ucxBWSource string

// ucxBWSetting is one way the ucx_c baseline moves a span: messages of
// size bytes (0: the whole span as one message), window of them in flight
// (0: every message of the span at once), on pages ("thp" or "4k").
type ucxBWSetting struct {
	size   int64
	window int
	pages  string
}

// ucxBWSettings: the backend's own shape first (4 MiB messages, a pool
// block of llama-3.1-8b at 32 tokens, every message of a request in
// flight at once, on huge pages, as the pools are registered), then fewer
// in flight, larger messages, one message for the whole span, and 4 KiB
// pages for comparison.
var ucxBWSettings = []ucxBWSetting{
	{4 << 20, 0, "thp"}, {4 << 20, 8, "thp"}, {16 << 20, 8, "thp"}, {0, 1, "thp"},
	{4 << 20, 0, "4k"}, {0, 1, "4k"},
}

// ucxBWRounds is how many spans each setting moves after its warm-up, as
// many as the requests a bench run measures by default; a setting's
// figure is their bytes over their summed time, the statistic of the runs
// it is compared with (the fastest round is printed too, not used).
const ucxBWRounds = 8

// ucxTLSNote says which transports UCX was told to use, as the UCX
// baselines' descriptions end (make bench-report checks it against the
// runs' UCX_TLS).
func ucxTLSNote() string {
	if tls, ok := os.LookupEnv("UCX_TLS"); ok {
		return ", UCX_TLS=" + tls
	}
	return ", UCX_TLS unset (UCX chooses)"
}

// ucxC builds ucxbw with cc and runs it with each of ucxBWSettings, over
// spans of the baseline's bytes (at most 1 GiB; rounded down to a whole
// number of messages), with this process's UCX_* environment (the one the
// backend under test runs with, UCX_TLS included). The best setting counts.
func (br *baselineRunner) ucxC(ctx context.Context) Baseline {
	b := Baseline{Name: BaselineUCXC, Bytes: br.bytes,
		Description: fmt.Sprintf("a C UCP program (cc; ucp_tag_send_nbx/ucp_tag_recv_nbx, busy polling) between two processes on memory each has written, %d rounds after a warm-up, their bytes over their time; best message size, window and page size", ucxBWRounds) + ucxTLSNote()}
	cc, err := br.lookPath("cc")
	if err != nil {
		b.Skipped = "cc is not installed (Debian package gcc)"
		return b
	}
	ctx, cancel := context.WithTimeout(ctx, br.timeout)
	defer cancel()
	exe, cleanup, err := buildC(ctx, cc, "ucxbw", ucxBWSource, "-lucp", "-lucs")
	if err != nil {
		b.Error = err.Error() + " (UCX's headers: Debian package libucx-dev)"
		return b
	}
	defer cleanup()
	span := min(br.bytes, 1<<30)
	for _, s := range ucxBWSettings {
		size := s.size
		if size == 0 || size > span {
			size = span
		}
		n := span / size * size
		window := int(n / size)
		if s.window > 0 {
			window = min(window, s.window)
		}
		args := []string{strconv.FormatInt(size, 10), strconv.Itoa(window), strconv.FormatInt(n, 10), strconv.Itoa(ucxBWRounds), s.pages}
		v := Variant{Setting: fmt.Sprintf("%s x %d in flight, %s pages", humanBytes(size), window, s.pages), Bytes: n * ucxBWRounds,
			Command: "ucxbw " + strings.Join(args, " ")}
		if slices.ContainsFunc(b.Variants, func(o Variant) bool { return o.Setting == v.Setting }) {
			continue // a span too small for the larger settings
		}
		out, err := exec.CommandContext(ctx, exe, args...).CombinedOutput()
		if err == nil {
			v.GBps, err = parseGBpsLine("ucxbw", out)
		}
		if kb, ok := ucxBWHugeKB(out); err == nil && s.pages == "thp" && ok && kb*1024 < n/2 {
			// The kernel did not grant the advice: say so rather than
			// label 4 KiB pages huge.
			v.Setting += fmt.Sprintf(" (advised; %s granted)", humanBytes(kb*1024))
		}
		if err != nil {
			v.Error = firstLine(err.Error()) + ": " + tail(out)
		}
		b.Variants = append(b.Variants, v)
	}
	b.pickBest()
	return b
}

// ucxBWHugeKB reads the receiver's hugepages_kb field from ucxbw's output
// (-1 there when /proc/self/smaps_rollup could not be read: not ok).
func ucxBWHugeKB(out []byte) (int64, bool) {
	for _, f := range strings.Fields(string(out)) {
		if v, ok := strings.CutPrefix(f, "hugepages_kb="); ok {
			kb, err := strconv.ParseInt(v, 10, 64)
			return kb, err == nil && kb >= 0
		}
	}
	return 0, false
}
