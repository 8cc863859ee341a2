// Package bench measures KV-cache transfers between a context instance and
// a generation instance running as separate OS processes: the generation
// side (this process) starts the context side (a child process of the same
// binary), has it prefill requests with known contents, pulls them over the
// chosen backend and reports bytes, GB/s, latency percentiles, the backend
// that actually carried the data and, with Verify, whether every byte
// matches the naive reference sharding.
package bench
