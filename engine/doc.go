// Package engine is kvxfer's reference engine: a small but real decoder-only
// transformer, sharded over TP×PP ranks inside one process, and an executor
// loop that drives the transceiver the way TensorRT-LLM's executor does. It
// exists so that the whole disaggregated path — prefill on a context
// instance, KV transfer, decode on a generation instance of another layout —
// runs on one machine and can be checked token for token against an
// aggregated run.
//
// It owns the model, the per-rank execution and the scheduling of requests.
// It does not own the transfer (package transceiver), the pool and its
// memory (package kvcache), the layout arithmetic (package layout), the
// public config (package config: the caller builds the transceiver from it)
// or HTTP (package serve).
//
// # Model
//
// Presets "tiny-gqa", "tiny-gqa2" and "tiny-mla" (see Preset) are Llama-
// and DeepSeek-shaped: token embedding, layers of RMSNorm → attention with
// rotary embeddings → residual → RMSNorm → SwiGLU MLP → residual, a final
// RMSNorm and an LM head. GQA layers cache K and V of KVHeads heads
// (kv_factor 2); MLA layers cache one latent "head" per token, the
// normalised compressed KV concatenated with a decoupled RoPE key
// (kv_factor 1, attention type MLA), and attend with the key up-projection
// absorbed into the query and the value up-projection applied after the
// weighted sum. Weights are drawn from a PCG stream seeded by the config,
// so a config is the whole model and nothing is downloaded. The tokenizer
// is byte-level: ids 0..255 are bytes, BOS = 256, EOS = 257.
//
// The KV cache lives in kvcache pool blocks in the configured dtype (fp32,
// fp16, bf16 or fp8 e4m3; conversions round to nearest even, fp8
// saturates), laid out per rank as [layers_in_stage, kv_factor,
// heads_on_rank, tokens_per_block, head_dim] (layout.CacheState.RankLayout).
// Attention always reads K and V back from the blocks, so an instance that
// computed a prompt and one that received it by transfer read the same
// quantised values. After a prefill the unused slots of the last block are
// zeroed: blocks come back from the pool with another request's KV in them,
// and that must never travel in a transfer.
//
// # Sharding and layout-invariant numerics
//
// An Instance has TP×PP ranks, each with its own pool. TP splits the query
// heads and the KV heads as layout.CacheState.HeadRange does (a KV head is
// duplicated on several ranks when there are fewer heads than ranks; with
// MLA every rank holds, and computes, the whole latent), the MLP in
// MLPChunks fixed chunks of its intermediate width, and the LM head by
// vocabulary rows. PP runs the stages in order, handing the hidden states
// on. Ranks of a stage run one after another in this process; inside a
// rank, large operations are split over the cores (rows of a projection,
// query heads or MLP chunks of the output projection, sequence × KV head
// of the attention), which never changes what any element is.
//
// The tokens generated, every logit and every KV byte are identical, bit
// for bit, whatever the layout. The rules that make it so:
//
//   - Weights are stored as float32, row-major with one row per output;
//     activations are float32 values held in float64. Every product of two
//     of them is exact in float64, so a fused multiply-add cannot change a
//     result either.
//   - Every dot product accumulates in float64 in an order fixed by its
//     length alone (dot32: four interleaved partial sums, which are the
//     four lanes of an AVX2 register), and is rounded to float32 at
//     defined points: after each projection, RMSNorm, RoPE, attention
//     output and residual add. A dot product is the same whether it is
//     computed alone or blocked with other rows and tokens (prefill runs
//     many tokens through one pass over the weights, decode batches many
//     sequences), by the AVX2/FMA kernels of kernels_amd64.s or the
//     portable Go ones (the only ones with -tags purego or off amd64), on
//     whichever core; tests check the kernels against each other and a
//     naive reference bit for bit, and a fuzz target keeps at it.
//   - Softmax and SiLU exponentials use the engine's own exp (expKernel:
//     the algorithm of the Go runtime's amd64 math.Exp on a CPU with FMA,
//     written with math.FMA, which is exact everywhere), so they are the
//     same bits on every machine, and the bits math.Exp gives on amd64
//     with FMA (this engine's numerics before it had its own exp). The
//     SIMD softmax computes four exponentials at a time with the same
//     operations and still sums the probabilities one after another in
//     order of position.
//   - Anything computed per head (q, k, v, RoPE, attention) is computed
//     wholly on one rank by the same code, so the KV bytes written to the
//     cache do not depend on the layout.
//   - The all-reduce does not sum per-rank partial sums (whose grouping
//     would change with TP). Each rank produces one partial vector per
//     query head or MLP chunk; the reduction adds those in their global
//     order, starting from zero, in float64, and rounds once. Every layout
//     adds the same numbers in the same order. (Summing per-rank float64
//     partials instead changes the last float64 bits of more than half of
//     the sums when TP changes, and, for this model, almost never the
//     float32 result; the fixed tree removes even that chance.)
//   - Seeded sampling draws the k-th generated token with PCG(seed, k), so
//     a context instance drawing the first token and a generation instance
//     drawing the rest draw what one instance would.
//
// Results are bit-identical across layouts, batch compositions and
// between processes on one architecture; math.Sincos (RoPE) may differ in
// the last bit across architectures.
//
// # Block reuse
//
// With Options.BlockReuse (kv_cache_config.enable_block_reuse), every full
// block of a request's KV cache is published in every rank's reuse index
// under its chained kvcache.BlockHash, from the root kvcache.RootHash of
// the request's CacheSalt: the prompt's blocks after its prefill (on a
// generation instance, after its transfer), and, when the request ends
// without error, the blocks its generated tokens filled. A published block
// is never written again: it is shared by every request that finds it, and
// stays cached after its last user until an allocation evicts it, least
// recently released first, tail blocks before the prefixes they extend.
//
// At admission a request pins the longest cached prefix of its prompt on
// every rank (the common length: the ranks' pools may have evicted
// differently) before it reserves the rest, and the prefill computes only
// the tokens after that prefix. At least the last prompt token is always
// computed (its logits give the first token), so a prompt that is cached
// whole reuses one block less. With PartialReuse
// (kv_cache_config.enable_partial_reuse) it also reuses the cached block
// whose first k tokens match the prompt's next ones and computes from
// token k: with CopyOnPartialReuse (copy_on_partial_reuse) by copying it
// into a block of its own, so that a block others hold serves too;
// without, only a block nobody holds, taken out of the reuse index and
// written in place.
// Since a token's KV depends only on the tokens up to it, and attention
// reads K and V back from the blocks in every case, outputs with reuse are
// bit-identical to outputs without (a property test checks tokens, logits
// and KV bytes over GQA and MLA, every dtype and several layouts).
//
// A generation_only request first looks its prompt up in its own cache the
// same way (whole blocks only) and asks the context instance only for the
// blocks after the prefix it found: the transceiver's "last N blocks" of
// the context request, which holds all of them, reused ones included. Its
// Usage.CachedTokens is the prefix found, Timing.TransferBlocks the blocks
// asked for. A context_only request reuses the context instance's cache
// for its prefill like any other.
//
// With EventBufferMaxSize, the engine keeps the last that many KV cache
// events (created, stored, removed) of rank 0's pool for KVEvents, which a
// kv_cache_aware router reads; CachedPrefix answers, read-only, what
// admission would reuse of a prompt now. Stats counts the prompt tokens
// admitted, the cached ones among them, and the blocks published and
// evicted.
//
// # Executor
//
// Engine owns an Instance, optionally a transceiver.Transceiver built by the
// caller on the instance's State() and Pools(), and one scheduler goroutine
// (started by Start or the first Submit, stopped by Close). Each iteration:
//
//  1. Requests whose client context ended are cancelled: queued and
//     decoding ones end at once; a transfer in flight is cancelled with
//     transceiver.Cancel and the request ends when the transceiver reports
//     it, since until then the transfer may write into its blocks.
//  2. Finished transfers are collected with CheckContextTransferStatus and
//     CheckGenTransferStatus with atLeast 0 (never blocking).
//  3. Waiting requests are admitted first come, first served while every
//     rank can allocate their blocks and the batch has room (blocks for the
//     prompt plus max_tokens are reserved up front, TensorRT-LLM's
//     GUARANTEED_NO_EVICT policy, so a running request never starves; with
//     block reuse the cached prefix is pinned first and only the rest is
//     allocated). generation_only requests start their pull
//     (RequestAndReceiveAsync) into the blocks of their prompt that their
//     cached prefix does not cover. When the head of the queue does not
//     fit and held context_only requests keep the blocks, the oldest held
//     request nobody is pulling (transceiver.Transceiver.Pulling: a pull
//     stuck past the staging hold limit counts as none) and that has been
//     held Options.ReleaseUnpulledAfter (2 s) is
//     released, one at a time, and the scheduler waits for its blocks
//     (or until the next one is due): a client that never pulls what it
//     asked for holds the pool for seconds, not kv_transfer_timeout_ms.
//  4. Admitted context phases are prefilled (up to MaxPrefillTokens prompt
//     tokens computed per iteration: a cached prefix does not count) and
//     their first token sampled. A context_only
//     request is handed to RespondAndSendAsync and answered at once with the
//     first token, the ContextPhaseParams (ctx_request_id, opaque state) and
//     the prompt's token ids: the client gets its answer before any KV
//     moves, and the engine drops its reference to the blocks, which the
//     transceiver holds until the pull or its deadline.
//  5. Every running request decodes one token, all of them in one batch
//     (Instance.DecodeBatch: one pass over the weights for the batch, each
//     request's logits bit-identical to a decode on its own); a
//     generation_only request joins them when its pull completes, after
//     emitting the context instance's first token.
//
// When nothing can run, the scheduler blocks: on CheckGenTransferStatus(1)
// when pulls are in flight (the generation side blocks on transfers only
// when nothing else can run), on CheckContextTransferStatus(1) when
// requests wait for blocks that the transceiver holds for context requests
// (the context side blocks only when its pool is exhausted), otherwise
// until a Submit, a cancel or Close interrupts the wait.
//
// A request ends with a final event: finish reason "length", "stop" (EOS,
// a stop token or a stop string, which the text excludes), "not_finished"
// (a context_only request whose generation continues elsewhere) or "error"
// (a failed or timed-out transfer, a cancel, Close), with usage and a time
// split (queue, prefill, KV transfer, first decode step). Its blocks are
// then back in the pools. A request that could never fit in the pool is
// refused by Submit with a *TooLongError.
package engine
