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
// limits in the same process: a single-thread copy, one raw TCP stream over
// loopback, and iperf3 and ucx_perftest when they are installed (bench
// never installs anything). With Sweep.TLS {false, true} every run is also
// made with mutual TLS on the transfer planes (certificates made for the
// run, the context process's handed over as files), and the cipher's limit
// on one core (openssl speed -evp aes-128-gcm, when installed) is measured
// in the same sweep and compared with the runs tcp carried over TLS. The
// Report it returns is written as a text
// table, JSON (ReportSchema is its JSON Schema), Markdown and a PNG chart
// drawn with gonum/plot.
//
// bench owns no transfer code: it drives package transceiver as an
// executor would. The command line (flags, exit status) is
// internal/cli's.
package bench
