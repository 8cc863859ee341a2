// Package launch starts a local disaggregated cluster for `kvxfer up`:
// every worker of a cluster file as its own process (this executable's
// `serve` verb, with a worker file, a port and TLS files made for it and the
// cluster secret in its environment), a wait until each answers /health,
// and the router in this process; Stop takes it all down again. A cluster
// whose backend resolves to MPI is started instead as one MPI world: one
// mpirun whose ranks run `serve-mpi` (UsesMPI, AssignMPIRank). Smoke
// checks a launched cluster: the same prompts through the router and to an
// aggregated worker must give the same answers.
//
// It owns processes and their files, not HTTP: the worker and the router
// are package serve's. Only internal/cli uses it.
package launch
