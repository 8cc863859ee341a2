// Package serving is kvxfer's serving benchmark (`kvxfer bench serve`):
// it sends a synthetic workload to an OpenAI-compatible /v1/completions
// endpoint (the router of a disaggregated cluster, or a worker) as
// streamed requests, times every chunk of every answer, and reports what
// users of `vllm bench serve`, genai-perf or aiperf read: TTFT, TPOT,
// inter-token latency and end-to-end latency (mean, p50, p90, p99),
// request and output-token throughput, goodput under an SLO, errors by
// kind, and from kvxfer's usage.kvxfer_timing the KV bytes moved per
// request and the share of TTFT spent moving them.
//
// The workload is a pure function of a seed (Workload.Conversations): no
// dataset is downloaded. Prompt and output lengths come from a Lengths
// distribution (fixed, uniform, or a chat-dataset-shaped histogram);
// conversations have one or more turns after a system prompt shared by
// all of them. Prompts are token ids (the engine's tokenizer is
// byte-level: ids 0..255 are bytes, 256 is BOS), so a prompt of N tokens
// is N ids, BOS first; outputs are asked for with max_tokens and
// ignore_eos, so an answer has exactly its requested length unless the
// server ends it early, and the report counts the tokens that came
// (usage.completion_tokens), not the ones asked for.
//
// A conversation's turns carry its history as chat traffic does: turn n
// is sent only once turn n−1 has finished, and its prompt is turn n−1's
// prompt, the answer the server actually returned (the token ids of its
// stream), then the new user text. Each turn carries its conversation's
// id (Options.ConversationField: a top-level conversation_id, or
// disaggregated_params.conversation_id, the field TensorRT-LLM's
// conversation router reads), unique to the run.
//
// Prefix reuse: from each answer's usage the report reads
// prompt_tokens_details.cached_tokens (the prefix-hit rate, cached over
// prompt tokens) and kvxfer_timing's kv_transfer_bytes,
// kv_transfer_blocks and kv_block_bytes; from the router's X-Kvxfer-Route
// header (PathHeader) the path a request took under conditional
// disaggregation (local or disaggregated). Independently of what the
// server says, the bench counts each turn's new blocks (NewBlocks): the
// prompt's blocks at Options.TokensPerBlock beyond the full blocks of
// what the previous turn of the conversation left cached, its prompt and
// its answer but the answer's last token (HeldTokens). Times the block
// size, that is what a reuse-aware transfer should move; the report gives
// the KV moved over it (target ≤ MovedOverNewTarget), and every figure
// per turn index (TurnMetrics) and TTFT per path (PathMetrics). Merge puts
// the reports of several clusters side by side, and WriteReuseSummary
// writes their summary for the README (perfreport.SpliceSection), a reproducing
// command per row (Report.CommandFor).
//
// Conversations start at a request rate (a Poisson process, or with
// burstiness other than 1 gamma-distributed gaps, as vllm's --burstiness)
// or all at once, with at most MaxConcurrency requests in flight, until
// NumPrompts requests were sent or Duration has passed (Arrivals, Run).
// Before each run, Warmup requests are sent one after the other and not
// measured: the first request through a fresh cluster also opens the KV
// transfer's connections, which is not what a steady state is like.
//
// Definitions, as vllm's: TTFT is the time from sending a request to the
// first chunk that carries a token; TPOT is (E2EL − TTFT) / (output
// tokens − 1) per request with more than one token; ITL is the gap between
// successive token-carrying chunks of one answer (every gap of every
// request is a sample); E2EL is the time from sending to the stream's
// end. Percentiles interpolate linearly between the closest ranks (numpy's
// default). Goodput is the number of completed requests that meet every
// SLO of the run per second of the run.
//
// RunSweep runs a run per rate and target, the targets of a rate one
// after the other with the same workload; with Sweep.Paired instead every
// conversation goes to each target in turn, one request at a time, the
// order rotating (RunPaired), so that a comparison of a disaggregated
// cluster with an aggregated worker is not skewed by load that drifts
// between runs, and the report adds the TTFT difference request by
// request (Report.PairedTTFTDeltaMs).
//
// The statistics, the workload and the arrival generator are pure (no
// goroutines, clocks or I/O); Run is the driver around them and Report
// writes the results as a text table, JSON (ReportSchema), Markdown and a
// PNG chart, with the report machinery of package bench. Starting a
// cluster to measure (internal/launch) and the flags are internal/cli's.
package serving
