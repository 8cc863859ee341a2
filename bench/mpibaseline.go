package bench

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
)

// BaselineMPI is the MPI baseline: a C program's bandwidth between the two
// ranks of a world, compared with runs that backend mpi carried.
const BaselineMPI = "mpi_c"

// mpiBWSource is the C program of the MPI baseline, built with mpicc at
// bench time: rank 0 sends rank 1 COUNT messages of SIZE bytes, keeping
// WINDOW of them in flight (MPI_Isend / MPI_Irecv, a new one posted as soon
// as one completes, MPI_Waitany), after a warm-up of WINDOW messages and a
// barrier; rank 1 acknowledges the last, and rank 0 prints the bytes per
// second as "gbps=N". The messages walk a buffer of SPAN bytes on each
// side (message i at offset (i mod SPAN/SIZE) x SIZE), the baseline's
// bytes, as a request's blocks do: a window of buffers used again and
// again would stay in the CPU's caches, which a KV cache of hundreds of
// MiB does not. PAGES is how the buffer is allocated: "malloc" (4 KiB
// pages where the kernel's THP mode is madvise, as a plain program gets
// them) or "huge" (2 MiB aligned and advised MADV_HUGEPAGE before it is
// first written, as transport/mpi advises the pools it registers; the
// kernel's single copy, cma, copies huge pages about twice as fast). The
// buffer is written before the run, so no variant reads the kernel's
// shared zero page. It is transport/mpi's cross-rank baseline
// (testdata/bw.c) with the sliding window of frames that the transport
// keeps, instead of rounds.
const mpiBWSource = `#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static void post(int rank, char *p, long size, int tag, MPI_Request *req) {
	if (rank == 0)
		MPI_Isend(p, (int)size, MPI_BYTE, 1, tag, MPI_COMM_WORLD, req);
	else
		MPI_Irecv(p, (int)size, MPI_BYTE, 0, tag, MPI_COMM_WORLD, req);
}

/* stream moves count messages of size bytes, window at a time, message i
   at slot i % slots of buf. */
static void stream(int rank, char *buf, long size, long slots, int window, long count, MPI_Request *reqs, long *slot) {
	long posted = 0;
	for (int i = 0; i < window && posted < count; i++, posted++) {
		slot[i] = posted % slots;
		post(rank, buf + (size_t)size * slot[i], size, 0, &reqs[i]);
	}
	for (long done = 0; done < count; done++) {
		int i;
		MPI_Waitany(window, reqs, &i, MPI_STATUS_IGNORE);
		if (posted < count) {
			slot[i] = posted % slots;
			post(rank, buf + (size_t)size * slot[i], size, 0, &reqs[i]);
			posted++;
		}
	}
}

int main(int argc, char **argv) {
	MPI_Init(&argc, &argv);
	if (argc != 6 || (strcmp(argv[5], "malloc") != 0 && strcmp(argv[5], "huge") != 0)) {
		fprintf(stderr, "usage: mpibw SIZE WINDOW COUNT SPAN malloc|huge\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	long size = atol(argv[1]), count = atol(argv[3]), span = atol(argv[4]);
	int window = atoi(argv[2]), rank;
	if (size <= 0 || window <= 0 || count <= 0 || span < size * window) {
		fprintf(stderr, "mpibw: SIZE, WINDOW and COUNT must be positive, SPAN at least SIZE x WINDOW\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	long slots = span / size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	size_t bytes = (size_t)size * slots;
	char *buf = NULL;
	if (strcmp(argv[5], "huge") == 0) {
		const size_t huge = (size_t)2 << 20;
		bytes = (bytes + huge - 1) / huge * huge;
		void *p = NULL;
		if (posix_memalign(&p, huge, bytes) == 0) {
			buf = p;
			if (madvise(buf, bytes, MADV_HUGEPAGE) != 0) {
				perror("mpibw: madvise MADV_HUGEPAGE");
				MPI_Abort(MPI_COMM_WORLD, 4);
			}
		}
	} else {
		buf = malloc(bytes);
	}
	MPI_Request *reqs = malloc(sizeof(MPI_Request) * window);
	long *slot = malloc(sizeof(long) * window);
	if (buf == NULL || reqs == NULL || slot == NULL) {
		fprintf(stderr, "mpibw: out of memory\n");
		MPI_Abort(MPI_COMM_WORLD, 3);
	}
	memset(buf, rank + 1, bytes);
	stream(rank, buf, size, slots, window, window, reqs, slot); /* warm-up */
	MPI_Barrier(MPI_COMM_WORLD);
	double start = MPI_Wtime();
	stream(rank, buf, size, slots, window, count, reqs, slot);
	char ack = 0;
	if (rank == 1)
		MPI_Send(&ack, 1, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
	else
		MPI_Recv(&ack, 1, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	double secs = MPI_Wtime() - start;
	if (rank == 0)
		printf("gbps=%.4f\n", (double)size * count / secs / 1e9);
	free(slot);
	free(reqs);
	free(buf);
	MPI_Finalize();
	return 0;
}
`

// mpiBWSettings are the message sizes and windows of the MPI baseline: the
// transport's own (16 MiB frames, four in flight: transport/mpi's
// defaults), the generic 4 MiB frames, and smaller ones with as many
// bytes in flight as those.
var mpiBWSettings = []struct {
	size   int64
	window int
}{{4 << 20, 4}, {16 << 20, 4}, {1 << 20, 16}}

// mpiBWPages are the buffers each setting runs on (the program's PAGES):
// malloc's, and huge pages, as the transport advises its registered pools.
var mpiBWPages = []string{"huge", "malloc"}

// mpiBaseline builds the C program with mpicc in a temporary directory and
// runs it under the mpirun flags of the mpi runs (component br.mpiBTL),
// with each of mpiBWSettings on each of mpiBWPages, moving the bytes of a
// run's measured requests (br.cfg.Requests of br.bytes) over a span of
// br.bytes; the best counts.
func (br *baselineRunner) mpiBaseline(ctx context.Context) Baseline {
	btl, err := mpiBTL(br.mpiBTL)
	b := Baseline{Name: BaselineMPI, Bytes: br.bytes,
		Description: fmt.Sprintf("a C MPI program (mpicc; MPI_Isend/MPI_Irecv, a window of messages) between two ranks of mpirun over btl %s, on written buffers of malloc's or huge pages, best message size and pages", btl)}
	if err != nil {
		b.Error = err.Error()
		return b
	}
	mpicc, err := br.lookPath("mpicc")
	if err != nil {
		b.Skipped = "mpicc is not installed (Debian package libopenmpi-dev)"
		return b
	}
	mpirun, err := lookMPIRun(br.lookPath)
	if err != nil {
		b.Skipped = "mpirun is not installed (Debian package openmpi-bin)"
		return b
	}
	ctx, cancel := context.WithTimeout(ctx, br.timeout)
	defer cancel()
	exe, cleanup, err := buildC(ctx, mpicc, "mpibw", mpiBWSource)
	if err != nil {
		b.Error = err.Error()
		return b
	}
	defer cleanup()
	// As many bytes as a run measures (its requests of the largest
	// size), over a span of one request: a figure averaged over as long
	// as the run's, not the best of a few short bursts.
	total := br.bytes * int64(max(1, br.cfg.Requests))
	b.Bytes = total
	for _, s := range mpiBWSettings {
		for _, pages := range mpiBWPages {
			b.Variants = append(b.Variants, runMPIBW(ctx, mpirun, btl, exe, s.size, s.window, br.bytes, total, pages))
		}
	}
	b.pickBest()
	return b
}

// runMPIBW runs the C program once: messages of size bytes, window in
// flight, about total bytes in all walking a buffer of span bytes, on
// buffers of pages.
func runMPIBW(ctx context.Context, mpirun, btl, exe string, size int64, window int, span, total int64, pages string) Variant {
	count := max(total/size, 2*int64(window))
	span = max(span, size*int64(window))
	args := mpirunArgs(btl, exe, strconv.FormatInt(size, 10), strconv.Itoa(window), strconv.FormatInt(count, 10), strconv.FormatInt(span, 10), pages)
	v := Variant{Setting: mpiBWSetting(size, window, pages), Bytes: size * count,
		Command: "mpirun " + strings.Join(args, " ")}
	cmd := exec.CommandContext(ctx, mpirun, args...)
	cmd.Env = mpirunEnv()
	out, err := cmd.CombinedOutput()
	if err == nil {
		v.GBps, err = parseGBpsLine("mpibw", out)
	}
	if err != nil {
		v.Error = firstLine(err.Error()) + ": " + tail(out)
	}
	return v
}

// mpiBWSetting names a setting of the MPI baseline, as its Variant does.
func mpiBWSetting(size int64, window int, pages string) string {
	return fmt.Sprintf("%s x %d in flight, %s pages", humanBytes(size), window, pages)
}
