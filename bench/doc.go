// Package bench measures KV-cache transfers between a context instance and
// a generation instance running as separate OS processes: the generation
// side (this process) starts the context side (a child process of the same
// binary), has it prefill requests with known contents, pulls them over the
// chosen backend and reports bytes, GB/s, transfers/s, latency percentiles,
// the backend that actually carried the data and, with Verify, whether
// every byte matches the naive reference sharding.
//
// Run is one run; RunSweep runs every combination of lists of backends,
// ISLs, concurrencies and dtypes, one after the other (memory stays bounded
// by the largest run), and with Sweep.Baseline measures the machine's own
// limits in the same process, each the best of the settings worth trying
// (Baseline.Variants records them): a memory copy on one and on two threads
// (Go's copy and C's memcpy), one raw TCP stream over loopback, and iperf3
// (one stream and as many as the tcp backend opens; write lengths 128K, 1M,
// 4M, each run twice) when installed; when a run uses backend ucx, ucx_perftest (two
// message sizes) when it is installed, and ucx_c, UCX on memory both sides
// have written (a C program built with cc against libucx at bench time,
// see ucxbaseline.go; message sizes, windows and page sizes), when cc and
// UCX's headers are (bench never installs anything). A ucx run is
// compared with both UCX baselines.
//
// With Sweep.Rounds above 1 (kvxfer bench --rounds N) the sweep measures
// in N rounds, in turns: round k measures every baseline once (trying
// every setting of each, as one round would)
// and then makes every run once, each with its own context process and
// warm-up, so that a baseline and a run are measured at the same moments
// of a noisy machine. A baseline's and a run's figure is the best of its
// rounds (each round's is in the report), a ratio is the best round over
// the best round, and Result.MedianRoundRatios gives the median of the
// per-round ratios, round k's run over round k's baseline; latency
// percentiles are of every round's requests pooled. A run that fails in
// a round fails, and is not made again (rounds.go).
//
// With Sweep.TLS {false, true} every run is also
// made with mutual TLS on the transfer planes (certificates made for the
// run, the context process's handed over as files), and the cipher's limit
// on one core (openssl speed -evp aes-128-gcm, when installed) is measured
// in the same sweep and compared with the runs tcp carried over TLS. The
// Report it returns is written as a text
// table, JSON (ReportSchema is its JSON Schema), Markdown and a PNG chart
// drawn with gonum/plot.
//
// With Config.ProcessPerRank (kvxfer bench --process-per-rank) every rank
// of both instances is an OS process of its own, the ranks of an instance
// agreeing through a transceiver.CoordinatedGroup, and this process only
// drives them; the run reports what that agreement cost per request
// (Result.AgreementP50Us and the rest; see perrank.go).
//
// A run with backend mpi (kvxfer bench --backend mpi) cannot use a child
// process: MPI moves data only between the ranks of one world. Run starts
// `mpirun -np 2 --bind-to none --oversubscribe --mca pml ob1 --mca btl
// self,BTL` on this executable's hidden `bench mpi-rank` command (see
// mpi.go): world rank 0 is the generation side and makes the run, rank 1
// is the context peer, answering the same JSON lines over a Unix socket,
// and Run returns rank 0's Result. BTL is Config.MPIBTL (vader, shared
// memory, by default; or tcp), pinned so that the backend the report names
// ("mpi(vader)", "mpi(tcp)") is the one that carried the data. Its
// baseline (mpi_c) is a small C MPI program that the sweep builds with
// mpicc and runs under the same mpirun flags, with the transport's message
// size (16 MiB frames, four in flight) and two others, each on malloc's and
// on huge pages, moving a run's measured bytes, the best counting;
// without mpicc (libopenmpi-dev) or mpirun (openmpi-bin) it is skipped
// with the package to install, and a run with backend mpi fails naming
// openmpi-bin.
//
// bench owns no transfer code: it drives package transceiver as an
// executor would. The command line (flags, exit status) is
// internal/cli's.
package bench
