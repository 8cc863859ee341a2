package bench

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// BaselineMPI is the MPI baseline: a C program's bandwidth between the two
// ranks of a world, compared with runs that backend mpi carried.
const BaselineMPI = "mpi_c"

// mpiBWSource is the C program of the MPI baseline, built with mpicc at
// bench time: rank 0 sends rank 1 WINDOW messages of SIZE bytes at once
// (MPI_Isend / MPI_Irecv, MPI_Waitall), ROUNDS times after one warm-up
// round, rank 1 acknowledging each round, and rank 0 prints the bytes per
// second as "gbps=N". It is the approach of transport/mpi's cross-rank
// baseline (testdata/bw.c), with the transport's traffic: windows of
// frames of one size.
const mpiBWSource = `#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
	MPI_Init(&argc, &argv);
	if (argc != 4) {
		fprintf(stderr, "usage: mpibw SIZE WINDOW ROUNDS\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	long size = atol(argv[1]);
	int window = atoi(argv[2]), rounds = atoi(argv[3]), rank;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	char *buf = malloc((size_t)size * window);
	MPI_Request *reqs = malloc(sizeof(MPI_Request) * window);
	if (buf == NULL || reqs == NULL) {
		fprintf(stderr, "mpibw: out of memory\n");
		MPI_Abort(MPI_COMM_WORLD, 3);
	}
	memset(buf, rank + 1, (size_t)size * window);
	double start = 0;
	for (int r = 0; r <= rounds; r++) {
		if (r == 1) {
			MPI_Barrier(MPI_COMM_WORLD);
			start = MPI_Wtime();
		}
		for (int i = 0; i < window; i++) {
			char *p = buf + (size_t)size * i;
			if (rank == 0)
				MPI_Isend(p, (int)size, MPI_BYTE, 1, i, MPI_COMM_WORLD, &reqs[i]);
			else
				MPI_Irecv(p, (int)size, MPI_BYTE, 0, i, MPI_COMM_WORLD, &reqs[i]);
		}
		MPI_Waitall(window, reqs, MPI_STATUSES_IGNORE);
		char ack = 0;
		if (rank == 1)
			MPI_Send(&ack, 1, MPI_BYTE, 0, window, MPI_COMM_WORLD);
		else
			MPI_Recv(&ack, 1, MPI_BYTE, 1, window, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	}
	double secs = MPI_Wtime() - start;
	if (rank == 0)
		printf("gbps=%.4f\n", (double)size * window * rounds / secs / 1e9);
	free(reqs);
	free(buf);
	MPI_Finalize();
	return 0;
}
`

// mpiBWSettings are the message sizes and windows of the MPI baseline: the
// transport's own (4 MiB frames, four in flight: transport/mpi's defaults),
// and larger messages with the same bytes in flight.
var mpiBWSettings = []struct {
	size   int64
	window int
}{{4 << 20, 4}, {16 << 20, 1}, {1 << 20, 16}}

// mpiBaseline builds the C program with mpicc in a temporary directory and
// runs it under the mpirun flags of the mpi runs (component br.mpiBTL),
// with each of mpiBWSettings; the best counts.
func (br *baselineRunner) mpiBaseline(ctx context.Context) Baseline {
	btl, err := mpiBTL(br.mpiBTL)
	b := Baseline{Name: BaselineMPI, Bytes: br.bytes,
		Description: fmt.Sprintf("a C MPI program (mpicc; MPI_Isend/MPI_Irecv, a window of messages) between two ranks of mpirun over btl %s, best message size", btl)}
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
	dir, err := os.MkdirTemp("", "kvxfer-bench-mpibw-")
	if err != nil {
		b.Error = err.Error()
		return b
	}
	defer os.RemoveAll(dir)
	src, exe := filepath.Join(dir, "mpibw.c"), filepath.Join(dir, "mpibw")
	if err := os.WriteFile(src, []byte(mpiBWSource), 0o600); err != nil {
		b.Error = err.Error()
		return b
	}
	if out, err := exec.CommandContext(ctx, mpicc, "-O2", "-o", exe, src).CombinedOutput(); err != nil {
		b.Error = fmt.Sprintf("mpicc -O2 -o mpibw mpibw.c: %v: %s", err, tail(out))
		return b
	}
	for _, s := range mpiBWSettings {
		rounds := max(br.bytes/(s.size*int64(s.window)), 4)
		args := mpirunArgs(btl, exe, strconv.FormatInt(s.size, 10), strconv.Itoa(s.window), strconv.FormatInt(rounds, 10))
		v := Variant{Setting: fmt.Sprintf("%s x %d in flight", humanBytes(s.size), s.window), Bytes: s.size * int64(s.window) * rounds,
			Command: "mpirun " + strings.Join(args, " ")}
		cmd := exec.CommandContext(ctx, mpirun, args...)
		cmd.Env = mpirunEnv()
		out, err := cmd.CombinedOutput()
		if err == nil {
			v.GBps, err = parseMPIBW(out)
		}
		if err != nil {
			v.Error = firstLine(err.Error()) + ": " + tail(out)
		}
		b.Variants = append(b.Variants, v)
	}
	b.pickBest()
	return b
}

// parseMPIBW reads the "gbps=N" line of the C program.
func parseMPIBW(out []byte) (float64, error) {
	for line := range strings.Lines(string(out)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "gbps="); ok {
			g, err := strconv.ParseFloat(v, 64)
			if err != nil || !(g > 0) || math.IsInf(g, 1) {
				return 0, fmt.Errorf("mpibw reported %q", v)
			}
			return g, nil
		}
	}
	return 0, fmt.Errorf("mpibw output has no gbps= line: %s", tail(out))
}
