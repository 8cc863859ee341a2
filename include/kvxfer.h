/*
 * kvxfer.h: the C ABI of libkvxfer, kvxfer's KV-cache transceiver as a
 * shared library (make lib builds lib/libkvxfer.so).
 *
 * Hand-written and versioned: KVXFER_ABI_VERSION changes whenever a
 * function, a struct or a code changes meaning; kvxfer_abi_version()
 * returns the version the loaded library implements. Check it at load.
 *
 * THE MODEL
 * A process hosts ranks of one instance (a context instance, or a
 * generation instance) and creates one transceiver for them from a config
 * and a cache-state description. The context side hands a finished prefill
 * to its transceiver (kvxfer_respond_and_send) and gets an opaque state;
 * the engine carries that state to the generation instance, whose
 * transceiver pulls the blocks into its own pool (kvxfer_request_and_receive).
 * Both sides poll for finished requests (kvxfer_check_*_status). There are
 * no callbacks into C.
 *
 * A process may host every rank of its instance, or some of them (one
 * process per GPU rank, as engines run): the processes of the instance
 * then form a group that agrees on each request (it completes only when
 * every rank has completed it; one rank's failure fails it on all), either
 * over kvxfer's own connections with the process of rank 0 coordinating
 * (KVXFER_GROUP_COORDINATED), or through an all-gather the engine runs on
 * its own communicator, polled round by round (KVXFER_GROUP_GATHER:
 * kvxfer_group_outbox, kvxfer_group_deliver, kvxfer_group_fail). Every
 * process of an instance makes the same calls for a request (same id,
 * same number of blocks); on the context side any process's opaque state
 * serves (rank 0's, as upstream), and it may be handed on as soon as that
 * process has it. A pull that reaches a rank whose process has not yet
 * called kvxfer_respond_and_send for the request is held by that rank
 * (as upstream's sender waits for the request to be ready) once the
 * instance's group has ordered another process's call for it (the group's
 * log is what makes a held pull unforgeable; a pull that comes even
 * before that is refused as an unknown request), and served when the call
 * comes. The hold is bounded: kv_transfer_timeout_ms from the request's
 * begin (then the pull is refused, saying so), the request's end on the
 * instance (a failure or cancel: refused), and a cap on held pulls per
 * control connection and per rank (past it, refused at once).
 *
 * MEMORY
 * A pool is the caller's memory (base != NULL: kvxfer reads and writes it,
 * never frees it, and stops touching it once kvxfer_transceiver_close
 * returns) or kvxfer's (base == NULL: a shareable memfd mapping that
 * kvxfer_transceiver_create returns in base, valid until close). Block b of
 * a pool is the block_bytes bytes at base + b*block_bytes, laid out
 *   [layers of the rank][kv_factor][heads of the rank][tokens_per_block][head_dim]
 * elements (row-major). The engine decides which blocks hold which request;
 * it must not reuse the blocks of a request until a status call has
 * reported that request finished.
 *
 * Pointers passed in are read during the call only, except pool memory.
 * No pointer to Go memory is ever given to C; handles are integers.
 *
 * ERRORS
 * Every function but kvxfer_abi_version and kvxfer_last_error returns a
 * kvxfer_status. On an error, kvxfer_last_error() returns a message that
 * names what is wrong and where. The message is per thread: it belongs to
 * the last failed call on the calling thread, and stays valid until the
 * next kvxfer call on that thread. Calls that succeed leave it unchanged.
 * It is whole however long (a config's every problem), up to 1 MiB, past
 * which it is cut at a line and ends "(kvxfer: message cut here)".
 *
 * THREADS
 * Every function may be called from any thread, concurrently, on the same
 * or on different handles. kvxfer_transceiver_close may run concurrently
 * with other calls on the handle; they then return KVXFER_ERR_BAD_HANDLE
 * or KVXFER_ERR_CLOSED. Blocking calls (the status calls with at_least > 0,
 * the sync receive) block only the calling thread.
 *
 * PROCESSES (read this)
 * The library contains a Go runtime, started when the library is loaded.
 *  - A Go runtime does not survive fork(): load the library in the final
 *    process (after any fork of worker processes), or dlopen it there. A
 *    forked child of the process that loaded it gets KVXFER_ERR_FORKED from
 *    every call (checked in C before entering Go): never a hang. fork
 *    followed at once by exec is fine.
 *  - Never load two Go c-shared libraries into one process: two Go
 *    runtimes in one process are not supported by Go.
 *  - Logs go to stderr; KVXFER_LOG_LEVEL=debug|info|warn|error (default
 *    warn) sets how much.
 */
#ifndef KVXFER_H
#define KVXFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVXFER_ABI_VERSION 1

/* Result codes. Values never change meaning within an ABI version. */
typedef enum kvxfer_status {
    KVXFER_OK = 0,
    KVXFER_ERR_INVALID_ARGUMENT = 1,  /* NULL, negative or inconsistent argument */
    KVXFER_ERR_CONFIG = 2,            /* invalid config; the message is `kvxfer config check`'s */
    KVXFER_ERR_BAD_HANDLE = 3,        /* handle 0, closed, or of another kind */
    KVXFER_ERR_BUFFER_TOO_SMALL = 4,  /* a buffer is too small; the size needed was returned */
    KVXFER_ERR_BAD_OPAQUE_STATE = 5,  /* opaque state undecodable, unsigned, forged, expired, replayed, or of another prompt */
    KVXFER_ERR_INCOMPATIBLE = 6,      /* the two instances' cache states cannot be paired */
    KVXFER_ERR_TIMEOUT = 7,           /* a wait or a transfer ran out of time */
    KVXFER_ERR_CANCELED = 8,          /* the request was cancelled */
    KVXFER_ERR_PEER = 9,              /* the peer refused, aborted, or was lost */
    KVXFER_ERR_CLOSED = 10,           /* the transceiver is closed */
    KVXFER_ERR_IN_FLIGHT = 11,        /* a request with this id is already in flight on this side */
    KVXFER_ERR_FORKED = 12,           /* called in a forked child of the loading process */
    KVXFER_ERR_TRANSFER = 13,         /* a transfer failed for another reason (see the message) */
    KVXFER_ERR_NOT_FOUND = 14,        /* no request with this id */
    KVXFER_ERR_INTERNAL = 15,         /* a bug of kvxfer; the message says what */
    KVXFER_ERR_UNSUPPORTED = 16,      /* not supported in this build or ABI version */
    KVXFER_ERR_GROUP = 17,            /* the instance's group of processes: not joined yet, lost, or bad */
} kvxfer_status;

/* Element types (dtype). */
enum {
    KVXFER_DTYPE_FP32 = 1,
    KVXFER_DTYPE_FP16 = 2,
    KVXFER_DTYPE_BF16 = 3,
    KVXFER_DTYPE_FP8 = 4,   /* e4m3 */
    KVXFER_DTYPE_INT8 = 5,
};

/* Attention types. */
enum {
    KVXFER_ATTENTION_DEFAULT = 0,  /* K and V per KV head */
    KVXFER_ATTENTION_MLA = 1,      /* one latent per token (kv_heads 1, kv_factor 1) */
};

/* An instance's cache state: the model's shape and its parallel layout.
 * Both instances of a pairing describe the same model; their layouts may
 * differ (TP2 context, TP1 generation). */
typedef struct kvxfer_cache_state {
    uint32_t struct_size;       /* sizeof(kvxfer_cache_state) */
    int32_t layers;             /* attention layers of the whole model */
    int32_t kv_heads;           /* global KV heads per layer */
    int32_t head_dim;           /* elements per head per token */
    int32_t tokens_per_block;
    int32_t kv_factor;          /* 2 (K and V) or 1 (K only); 0: 1 for MLA, else 2 */
    int32_t dtype;              /* KVXFER_DTYPE_* */
    int32_t attention;          /* KVXFER_ATTENTION_* */
    int32_t tp;                 /* tensor-parallel size */
    int32_t pp;                 /* pipeline-parallel size */
    int32_t attention_dp;       /* 1: attention data parallelism over dp_size groups */
    int32_t dp_size;            /* DP groups (attention_dp); 0 or 1 otherwise */
    const int32_t *layers_per_pp; /* layers of each PP stage, pp entries; NULL: an even split */
} kvxfer_cache_state;

/* One hosted rank's pool. */
typedef struct kvxfer_pool {
    void *base;                 /* the caller's memory; NULL: kvxfer allocates (shareable) and sets it */
    uint64_t size;              /* bytes at base (at least num_blocks*block_bytes); set by kvxfer when it allocates */
    int32_t num_blocks;
    uint64_t block_bytes;       /* 0: set by kvxfer to the rank's block size; else must equal it */
} kvxfer_pool;

/* Group modes. */
enum {
    KVXFER_GROUP_NONE = 0,         /* this process hosts every rank of the instance */
    KVXFER_GROUP_COORDINATED = 1,  /* over kvxfer's connections; rank 0's process coordinates */
    KVXFER_GROUP_GATHER = 2,       /* through the caller's all-gather (kvxfer_group_*) */
};

/* The group of an instance split over processes. */
typedef struct kvxfer_group {
    uint32_t struct_size;       /* sizeof(kvxfer_group) */
    int32_t mode;               /* KVXFER_GROUP_* */
    int32_t process;            /* this process's index in [0, processes) (gather: its place in the all-gather) */
    int32_t processes;          /* the processes of the instance */
    const char *coordinator;    /* coordinated: host:port rank 0's process listens on, the others dial */
    int64_t join_timeout_ms;    /* coordinated: how long create waits for the join; <= 0: 60 s */
} kvxfer_group;

/* A finished request as a status call reports it. */
typedef struct kvxfer_finished {
    uint64_t request_id;
    int32_t status;             /* KVXFER_OK, or why the transfer failed (kvxfer_request_error has the message) */
} kvxfer_finished;

/* Versions. kvxfer_abi_version never fails and may be called anywhere,
 * a forked child included. kvxfer_version writes the library's version
 * ("kvxfer <revision>") with its terminating NUL into buf; *len gets the
 * length without the NUL (KVXFER_ERR_BUFFER_TOO_SMALL when cap <= *len). */
uint32_t kvxfer_abi_version(void);
int kvxfer_version(char *buf, size_t cap, size_t *len);

/* The message of the last failed call on this thread ("" if none). */
const char *kvxfer_last_error(void);

/* Configs. A config is a worker file (TensorRT-LLM's extra LLM API options)
 * with cache_transceiver_config, loaded with `kvxfer config check`'s rules
 * and messages, the environment (TRTLLM_*) applied; its security block's
 * secret and TLS files are read here. With a cluster secret
 * (security.secret_file, or KVXFER_CLUSTER_SECRET in the environment the
 * library was loaded with) opaque states are signed and checked; without
 * one the transceiver says once, on stderr, that it is unauthenticated. kvxfer_config_load_yaml takes the
 * YAML text (len bytes; JSON is YAML too), named name in messages (NULL:
 * "config"); kvxfer_config_load_file a path (a named pipe: its writer's
 * data is waited for at most 10 s, else an error naming it). Free with kvxfer_config_free
 * (idempotent); transceivers made from it stay valid. */
int kvxfer_config_load_yaml(const char *text, size_t len, const char *name, uint64_t *config);
int kvxfer_config_load_file(const char *path, uint64_t *config);
int kvxfer_config_free(uint64_t config);

/* Transceivers. kvxfer_transceiver_create opens the ranks listed in ranks
 * (n_ranks of them; NULL and 0: every rank of the instance) with pools[i]
 * for ranks[i], on listen_host (NULL: 127.0.0.1). For a pool with base
 * NULL it allocates a shareable pool and writes base, size and
 * block_bytes; for the others it checks them and fills block_bytes when 0.
 * kvxfer_block_bytes computes the block size of a rank without opening
 * anything. ranks must be ascending. When they are not every rank, group
 * (NULL: none) says how this process agrees with the others; in
 * coordinated mode create returns once every process has joined (on rank
 * 0's process it waits for the others to dial in, at most
 * join_timeout_ms); in gather mode it returns at once and the join is the
 * first round (until it is delivered, calls return KVXFER_ERR_GROUP). */
int kvxfer_block_bytes(const kvxfer_cache_state *state, int32_t rank, uint64_t *block_bytes);
int kvxfer_transceiver_create(uint64_t config, const kvxfer_cache_state *state,
                              const int32_t *ranks, size_t n_ranks, kvxfer_pool *pools,
                              const kvxfer_group *group, const char *listen_host, uint64_t *transceiver);

/* Gather mode: each round, every process of the instance takes its
 * contribution (kvxfer_group_outbox: the same bytes until a call
 * succeeds, so a caller whose buffer was too small asks again), the caller
 * all-gathers them over its communicator, and every process delivers all
 * n contributions in process order (kvxfer_group_deliver: flat holds them
 * one after the other, lens their lengths; n is the group's processes,
 * another n is KVXFER_ERR_INVALID_ARGUMENT and leaves the round to be
 * delivered again, while a round that is not one, a contribution that does
 * not decode, breaks the group: KVXFER_ERR_GROUP). Every process takes part in
 * every round (an empty contribution is fine); rounds must not overlap. A
 * request completes at the round after its last rank's report, so run
 * rounds often (every few hundred microseconds while requests are in
 * flight). When a round fails (a process died), call kvxfer_group_fail on
 * every surviving process: its requests in flight fail, new ones are
 * refused (KVXFER_ERR_GROUP). */
int kvxfer_group_outbox(uint64_t transceiver, uint8_t *buf, size_t cap, size_t *len);
int kvxfer_group_deliver(uint64_t transceiver, const uint8_t *flat, const size_t *lens, size_t n);
int kvxfer_group_fail(uint64_t transceiver, const char *why);
/* Fails every transfer in flight, stops the ranks, frees kvxfer's pools;
 * the caller's pools are no longer touched once it returns. Idempotent:
 * closing a closed handle returns KVXFER_OK. */
int kvxfer_transceiver_close(uint64_t transceiver);

/* Context side: hand request_id, whose prefill of num_tokens tokens
 * (0: unknown) fills n_blocks blocks on every hosted rank, to the
 * transceiver. block_ids holds n_hosted_ranks * n_blocks ids, those of
 * hosted rank i at [i*n_blocks, (i+1)*n_blocks). dp_rank is the request's
 * attention-DP group (0 without attention DP). The transceiver holds the
 * request until the generation side has pulled it or
 * kv_transfer_timeout_ms has passed.
 * The opaque state is written to opaque (cap bytes) and its length to
 * *opaque_len. When cap is too small the request is still started,
 * KVXFER_OK is returned with *opaque_len > cap and nothing written: fetch
 * it with kvxfer_context_opaque_state (opaque may be NULL, cap 0). */
int kvxfer_respond_and_send(uint64_t transceiver, uint64_t request_id, int32_t dp_rank, int32_t num_tokens,
                            const int32_t *block_ids, size_t n_blocks,
                            uint8_t *opaque, size_t cap, size_t *opaque_len);
/* The opaque state of a context request in flight (not yet reported by a
 * status call); KVXFER_ERR_BUFFER_TOO_SMALL with *opaque_len when cap is
 * too small. */
int kvxfer_context_opaque_state(uint64_t transceiver, uint64_t request_id,
                                uint8_t *opaque, size_t cap, size_t *opaque_len);

/* Generation side: start pulling the context request that the opaque
 * state names into block_ids (as for respond), as generation request
 * request_id. num_tokens, when not 0, must equal the context request's
 * (else KVXFER_ERR_BAD_OPAQUE_STATE: the prompt is not that request's).
 * The async call returns at once; the sync call waits for the end, at most
 * timeout_ms (< 0: no bound but the transfer's own), cancels the pull on
 * timeout (KVXFER_ERR_TIMEOUT), and its request is reported by no status
 * call. */
int kvxfer_request_and_receive(uint64_t transceiver, uint64_t request_id, int32_t dp_rank, int32_t num_tokens,
                               const uint8_t *opaque, size_t opaque_len,
                               const int32_t *block_ids, size_t n_blocks);
int kvxfer_request_and_receive_sync(uint64_t transceiver, uint64_t request_id, int32_t dp_rank, int32_t num_tokens,
                                    const uint8_t *opaque, size_t opaque_len,
                                    const int32_t *block_ids, size_t n_blocks, int64_t timeout_ms);

/* Status: the requests of one side whose transfers ended, each reported
 * once, into out (room for cap), their number into *n. The call first
 * waits until at least at_least have ended or none is in flight
 * (at_least 0: never waits; < 0: waits for every request in flight), at
 * most timeout_ms (< 0: no bound but the transfers' own deadlines); on
 * timeout it returns KVXFER_ERR_TIMEOUT and still reports what has ended.
 * More than cap ended: the rest wait for the next call. */
int kvxfer_check_context_status(uint64_t transceiver, int32_t at_least, int64_t timeout_ms,
                                kvxfer_finished *out, size_t cap, size_t *n);
int kvxfer_check_gen_status(uint64_t transceiver, int32_t at_least, int64_t timeout_ms,
                            kvxfer_finished *out, size_t cap, size_t *n);
/* The message of a request a status call reported failed (is_gen: the
 * generation side's). The last 4096 failures of each side are kept. Same
 * buffer rules as kvxfer_version. */
int kvxfer_request_error(uint64_t transceiver, int32_t is_gen, uint64_t request_id,
                         char *buf, size_t cap, size_t *len);
/* *complete = 1 when no generation transfer is in flight. */
int kvxfer_gen_transfer_complete(uint64_t transceiver, int32_t *complete);
/* Cancels request_id on whichever side it is in flight; *cancelled = 1 when
 * a transfer was cancelled (it is then reported with KVXFER_ERR_CANCELED),
 * 0 when none was in flight. cancelled may be NULL. */
int kvxfer_cancel(uint64_t transceiver, uint64_t request_id, int32_t *cancelled);

#ifdef __cplusplus
}
#endif
#endif /* KVXFER_H */
