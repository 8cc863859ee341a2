//go:build mpi && cgo

#include <string.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include "kxmpi.h"

int kxm_init(int *provided) {
	int done = 0;
	MPI_Initialized(&done);
	if (done) {
		return MPI_Query_thread(provided);
	}
	return MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
}

int kxm_setup(MPI_Comm *data, MPI_Comm *ctl, int *rank, int *size, int *tagub, unsigned long long *epoch) {
	int rc, flag = 0;
	int *ub = NULL;
	if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, data)) != MPI_SUCCESS) return rc;
	if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, ctl)) != MPI_SUCCESS) return rc;
	MPI_Comm_set_errhandler(*data, MPI_ERRORS_RETURN);
	MPI_Comm_set_errhandler(*ctl, MPI_ERRORS_RETURN);
	if ((rc = MPI_Comm_rank(*data, rank)) != MPI_SUCCESS) return rc;
	if ((rc = MPI_Comm_size(*data, size)) != MPI_SUCCESS) return rc;
	if ((rc = MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag)) != MPI_SUCCESS) return rc;
	*tagub = (flag && ub) ? *ub : 32767;
	// The world's epoch: rank 0's clock and pid, so that a descriptor of
	// another world (an earlier run) is refused.
	if (*rank == 0) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		*epoch = ((unsigned long long)ts.tv_sec << 32) ^ (unsigned long long)ts.tv_nsec ^ ((unsigned long long)getpid() << 20);
		if (*epoch == 0) *epoch = 1;
	}
	return MPI_Bcast(epoch, 1, MPI_UNSIGNED_LONG_LONG, 0, *ctl);
}

int kxm_finalize(MPI_Comm *data, MPI_Comm *ctl) {
	MPI_Comm_free(data);
	MPI_Comm_free(ctl);
	return MPI_Finalize();
}

int kxm_isend(void *buf, int count, int dest, int tag, MPI_Comm comm, MPI_Request *req) {
	return MPI_Isend(buf, count, MPI_BYTE, dest, tag, comm, req);
}

int kxm_irecv(void *buf, int count, int src, int tag, MPI_Comm comm, MPI_Request *req) {
	return MPI_Irecv(buf, count, MPI_BYTE, src, tag, comm, req);
}

// A scattered message is one message of an hindexed type of bytes at
// absolute addresses (MPI_BOTTOM); the type is freed at once (the request
// keeps what it needs).
static int vtype(const MPI_Aint *addrs, const int *lens, int n, MPI_Datatype *t) {
	int rc = MPI_Type_create_hindexed(n, lens, addrs, MPI_BYTE, t);
	if (rc != MPI_SUCCESS) return rc;
	return MPI_Type_commit(t);
}

int kxm_isendv(const MPI_Aint *addrs, const int *lens, int n, int dest, int tag, MPI_Comm comm, MPI_Request *req) {
	MPI_Datatype t;
	int rc = vtype(addrs, lens, n, &t);
	if (rc != MPI_SUCCESS) return rc;
	rc = MPI_Isend(MPI_BOTTOM, 1, t, dest, tag, comm, req);
	MPI_Type_free(&t);
	return rc;
}

int kxm_irecvv(const MPI_Aint *addrs, const int *lens, int n, int src, int tag, MPI_Comm comm, MPI_Request *req) {
	MPI_Datatype t;
	int rc = vtype(addrs, lens, n, &t);
	if (rc != MPI_SUCCESS) return rc;
	rc = MPI_Irecv(MPI_BOTTOM, 1, t, src, tag, comm, req);
	MPI_Type_free(&t);
	return rc;
}

int kxm_cancel(MPI_Request *req) { return MPI_Cancel(req); }

int kxm_testsome(int n, MPI_Request *reqs, int *outcount, int *indices, MPI_Status *st) {
	return MPI_Testsome(n, reqs, outcount, indices, st);
}

// kxm_progress tests the requests (MPI_Testsome, which makes progress)
// until at least one completes, *bell becomes nonzero (the Go side has
// work for the progress goroutine: its doorbell), an MPI call fails, or
// budget_ns have passed; it returns as kxm_testsome does (outcount 0 on a
// timeout or a rung bell). The whole wait is one cgo call, so the locked
// OS thread of the progress goroutine waits here, in C, as MPI_Waitsome
// would, rather than going through Go's scheduler once per test. Between
// two tests it yields the CPU (sched_yield) when nap_ns is 0, so that the
// threads the next control message waits for run where cores are few;
// otherwise it sleeps nap_ns (a rank whose only data in flight are sends:
// the receiving rank makes the copy, and a sender spinning beside it
// takes a core the copy or the other threads need).
int kxm_progress(int n, MPI_Request *reqs, int *outcount, int *indices, MPI_Status *st, int *bell, long long budget_ns, long long nap_ns) {
	struct timespec t0, t;
	struct timespec nap = {nap_ns / 1000000000LL, nap_ns % 1000000000LL};
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (unsigned long i = 0;; i++) {
		int rc = MPI_Testsome(n, reqs, outcount, indices, st);
		if (rc != MPI_SUCCESS || (*outcount != MPI_UNDEFINED && *outcount > 0)) return rc;
		if (__atomic_load_n(bell, __ATOMIC_ACQUIRE) != 0) {
			*outcount = 0;
			return MPI_SUCCESS;
		}
		if (nap_ns > 0) {
			nanosleep(&nap, NULL);
		} else {
			sched_yield();
		}
		if (nap_ns > 0 || (i & 15) == 15) {
			clock_gettime(CLOCK_MONOTONIC, &t);
			if ((long long)(t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) >= budget_ns) {
				*outcount = 0;
				return MPI_SUCCESS;
			}
		}
	}
}

void kxm_status(MPI_Status *st, int *source, int *count, int *cancelled, int *error) {
	*source = st->MPI_SOURCE;
	*error = st->MPI_ERROR;
	*cancelled = 0;
	MPI_Test_cancelled(st, cancelled);
	*count = 0;
	if (!*cancelled) {
		// Bytes, whatever the type: MPI_Get_count with MPI_BYTE.
		MPI_Get_count(st, MPI_BYTE, count);
	}
}

int kxm_any_source(void) { return MPI_ANY_SOURCE; }

void kxm_errstr(int code, char *buf, int len) {
	int n = 0;
	char s[MPI_MAX_ERROR_STRING];
	if (MPI_Error_string(code, s, &n) != MPI_SUCCESS) n = 0;
	if (n >= len) n = len - 1;
	memcpy(buf, s, n);
	buf[n] = 0;
}

int kxm_request_null(MPI_Request *req) { *req = MPI_REQUEST_NULL; return MPI_UNDEFINED; }

void kxm_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }
