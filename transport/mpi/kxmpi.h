// C side of package mpi: thin wrappers over OpenMPI, so that Go never names
// an MPI handle macro (they expand to addresses of library globals).
#ifndef KXMPI_H
#define KXMPI_H

#include <mpi.h>

int kxm_init(int *provided);
int kxm_setup(MPI_Comm *data, MPI_Comm *ctl, int *rank, int *size, int *tagub, unsigned long long *epoch);
int kxm_finalize(MPI_Comm *data, MPI_Comm *ctl);
int kxm_isend(void *buf, int count, int dest, int tag, MPI_Comm comm, MPI_Request *req);
int kxm_irecv(void *buf, int count, int src, int tag, MPI_Comm comm, MPI_Request *req);
int kxm_isendv(const MPI_Aint *addrs, const int *lens, int n, int dest, int tag, MPI_Comm comm, MPI_Request *req);
int kxm_irecvv(const MPI_Aint *addrs, const int *lens, int n, int src, int tag, MPI_Comm comm, MPI_Request *req);
int kxm_cancel(MPI_Request *req);
int kxm_testsome(int n, MPI_Request *reqs, int *outcount, int *indices, MPI_Status *st);
int kxm_progress(int n, MPI_Request *reqs, int *outcount, int *indices, MPI_Status *st, int *bell, long long budget_ns, long long nap_ns);
void kxm_status(MPI_Status *st, int *source, int *count, int *cancelled, int *error);
int kxm_any_source(void);
void kxm_errstr(int code, char *buf, int len);
int kxm_request_null(MPI_Request *req);
void kxm_abort(int code);

#endif
