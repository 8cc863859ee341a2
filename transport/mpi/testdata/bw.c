// bw.c: the baseline of TestCrossRankBandwidth, in plain C MPI: rank 0
// sends rank 1 WINDOW messages of SIZE bytes at once (MPI_Isend, MPI_Irecv,
// MPI_Waitall), ROUNDS times after one warm-up round, and prints GB/s.
//
//	mpicc -O2 -o bw bw.c && mpirun -np 2 ./bw 65536 64 64
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
	MPI_Init(&argc, &argv);
	if (argc != 4) {
		fprintf(stderr, "usage: bw SIZE WINDOW ROUNDS\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	long size = atol(argv[1]);
	int window = atoi(argv[2]), rounds = atoi(argv[3]), rank;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	char *buf = malloc((size_t)size * window);
	memset(buf, rank + 1, (size_t)size * window);
	MPI_Request *reqs = malloc(sizeof(MPI_Request) * window);
	double start = 0;
	for (int r = 0; r <= rounds; r++) {
		if (r == 1) {
			MPI_Barrier(MPI_COMM_WORLD);
			start = MPI_Wtime();
		}
		for (int i = 0; i < window; i++) {
			char *p = buf + (size_t)size * i;
			if (rank == 0) MPI_Isend(p, (int)size, MPI_BYTE, 1, i, MPI_COMM_WORLD, &reqs[i]);
			else MPI_Irecv(p, (int)size, MPI_BYTE, 0, i, MPI_COMM_WORLD, &reqs[i]);
		}
		MPI_Waitall(window, reqs, MPI_STATUSES_IGNORE);
		char ack = 0;
		if (rank == 1) MPI_Send(&ack, 1, MPI_BYTE, 0, 1 << 20, MPI_COMM_WORLD);
		else MPI_Recv(&ack, 1, MPI_BYTE, 1, 1 << 20, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	}
	double secs = MPI_Wtime() - start;
	if (rank == 0)
		printf("c mpi: %ld-byte messages, %d at once, %d rounds: %.2f GB/s\n", size, window, rounds,
		       (double)size * window * rounds / secs / 1e9);
	free(reqs);
	free(buf);
	MPI_Finalize();
	return 0;
}
