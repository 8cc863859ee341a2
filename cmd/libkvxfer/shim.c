// The public functions of include/kvxfer.h. Each checks, in C and before
// entering Go, that it runs in the process that loaded the library (a Go
// runtime does not survive fork: a forked child that entered Go would
// hang), then calls the Go function of the same name with kvxfer_go_ in
// front (main.go). The last-error message is a C thread-local buffer,
// which the Go functions fill through kvxfer_shim_set_error: a C caller's
// call into Go runs on the caller's own thread.

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "kvxfer.h"
#include "_cgo_export.h"

static pid_t kvxfer_load_pid;

__attribute__((constructor)) static void kvxfer_record_pid(void) { kvxfer_load_pid = getpid(); }

// The message is per thread through a pthread key (freed when the thread
// exits), not a __thread array: a dlopen()ed library has only a small
// surplus of static TLS, which a large __thread array would exhaust
// ("cannot allocate memory in static TLS block"). It grows to the message
// (config check's every problem at once runs to many kilobytes), up to
// KVXFER_ERR_MAX, past which it is cut at a line and says so.
enum { KVXFER_ERR_CAP = 4096, KVXFER_ERR_MAX = 1 << 20 };
typedef struct kvxfer_err {
    size_t cap; // bytes of msg
    char msg[];
} kvxfer_err;
static pthread_key_t kvxfer_err_key;
static pthread_once_t kvxfer_err_once = PTHREAD_ONCE_INIT;

static void kvxfer_err_key_init(void) { pthread_key_create(&kvxfer_err_key, free); }

// kvxfer_err_buf returns this thread's message, with room for at least
// need bytes (its NUL included) when it can have it, or NULL when it has
// none at all.
static kvxfer_err *kvxfer_err_buf(size_t need) {
    pthread_once(&kvxfer_err_once, kvxfer_err_key_init);
    kvxfer_err *e = pthread_getspecific(kvxfer_err_key);
    if (e != NULL && e->cap >= need) {
        return e;
    }
    size_t cap = need > KVXFER_ERR_CAP ? need : KVXFER_ERR_CAP;
    kvxfer_err *grown = realloc(e, sizeof(kvxfer_err) + cap);
    if (grown == NULL) {
        return e; // the old one, smaller: the message is cut to it
    }
    if (e == NULL) {
        grown->msg[0] = 0;
    }
    grown->cap = cap;
    if (pthread_setspecific(kvxfer_err_key, grown) != 0) {
        free(grown);
        return NULL;
    }
    return grown;
}

void kvxfer_shim_set_error(const char *msg, size_t len) {
    static const char cut[] = "\n(kvxfer: message cut here)";
    size_t want = len < KVXFER_ERR_MAX ? len + 1 : KVXFER_ERR_MAX;
    kvxfer_err *e = kvxfer_err_buf(want);
    if (e == NULL) {
        return;
    }
    if (len < e->cap) {
        memcpy(e->msg, msg, len);
        e->msg[len] = 0;
        return;
    }
    // Too long: cut at the last line that fits with the note (in a line
    // when it is the first).
    size_t room = e->cap - sizeof(cut), keep = room;
    while (keep > 0 && msg[keep] != '\n') {
        keep--;
    }
    if (keep == 0) {
        keep = room;
    }
    memcpy(e->msg, msg, keep);
    memcpy(e->msg + keep, cut, sizeof(cut));
}

const char *kvxfer_last_error(void) {
    kvxfer_err *e = kvxfer_err_buf(1);
    return e != NULL ? e->msg : "kvxfer: no memory for the error message";
}

uint32_t kvxfer_abi_version(void) { return KVXFER_ABI_VERSION; }

#define KVXFER_NOT_FORKED                                                                      \
    do {                                                                                       \
        pid_t self = getpid();                                                                 \
        if (self != kvxfer_load_pid) {                                                         \
            kvxfer_err *e_ = kvxfer_err_buf(KVXFER_ERR_CAP);                                   \
            if (e_ != NULL)                                                                    \
                snprintf(e_->msg, e_->cap,                                                     \
                     "kvxfer: %s called in process %d, a forked child of process %d, which "   \
                     "loaded libkvxfer: the Go runtime inside it does not survive fork; load " \
                     "the library in the final process (after the fork)",                      \
                     __func__, (int)self, (int)kvxfer_load_pid);                               \
            return KVXFER_ERR_FORKED;                                                          \
        }                                                                                      \
    } while (0)

int kvxfer_version(char *buf, size_t cap, size_t *len) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_version(buf, cap, len);
}

int kvxfer_config_load_yaml(const char *text, size_t len, const char *name, uint64_t *config) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_config_load_yaml((char *)text, len, (char *)name, config);
}

int kvxfer_config_load_file(const char *path, uint64_t *config) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_config_load_file((char *)path, config);
}

int kvxfer_config_free(uint64_t config) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_config_free(config);
}

int kvxfer_block_bytes(const kvxfer_cache_state *state, int32_t rank, uint64_t *block_bytes) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_block_bytes((kvxfer_cache_state *)state, rank, block_bytes);
}

int kvxfer_transceiver_create(uint64_t config, const kvxfer_cache_state *state, const int32_t *ranks,
                              size_t n_ranks, kvxfer_pool *pools, const kvxfer_group *group,
                              const char *listen_host, uint64_t *transceiver) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_transceiver_create(config, (kvxfer_cache_state *)state, (int32_t *)ranks, n_ranks,
                                        pools, (kvxfer_group *)group, (char *)listen_host, transceiver);
}

int kvxfer_group_outbox(uint64_t transceiver, uint8_t *buf, size_t cap, size_t *len) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_group_outbox(transceiver, buf, cap, len);
}

int kvxfer_group_deliver(uint64_t transceiver, const uint8_t *flat, const size_t *lens, size_t n) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_group_deliver(transceiver, (uint8_t *)flat, (size_t *)lens, n);
}

int kvxfer_group_fail(uint64_t transceiver, const char *why) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_group_fail(transceiver, (char *)why);
}

int kvxfer_transceiver_close(uint64_t transceiver) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_transceiver_close(transceiver);
}

int kvxfer_respond_and_send(uint64_t transceiver, uint64_t request_id, int32_t dp_rank, int32_t num_tokens,
                            const int32_t *block_ids, size_t n_blocks, uint8_t *opaque, size_t cap,
                            size_t *opaque_len) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_respond_and_send(transceiver, request_id, dp_rank, num_tokens, (int32_t *)block_ids,
                                      n_blocks, opaque, cap, opaque_len);
}

int kvxfer_context_opaque_state(uint64_t transceiver, uint64_t request_id, uint8_t *opaque, size_t cap,
                                size_t *opaque_len) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_context_opaque_state(transceiver, request_id, opaque, cap, opaque_len);
}

int kvxfer_request_and_receive(uint64_t transceiver, uint64_t request_id, int32_t dp_rank, int32_t num_tokens,
                               const uint8_t *opaque, size_t opaque_len, const int32_t *block_ids,
                               size_t n_blocks) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_request_and_receive(transceiver, request_id, dp_rank, num_tokens, (uint8_t *)opaque,
                                         opaque_len, (int32_t *)block_ids, n_blocks, 0, 0);
}

int kvxfer_request_and_receive_sync(uint64_t transceiver, uint64_t request_id, int32_t dp_rank,
                                    int32_t num_tokens, const uint8_t *opaque, size_t opaque_len,
                                    const int32_t *block_ids, size_t n_blocks, int64_t timeout_ms) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_request_and_receive(transceiver, request_id, dp_rank, num_tokens, (uint8_t *)opaque,
                                         opaque_len, (int32_t *)block_ids, n_blocks, 1, timeout_ms);
}

int kvxfer_check_context_status(uint64_t transceiver, int32_t at_least, int64_t timeout_ms,
                                kvxfer_finished *out, size_t cap, size_t *n) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_check_status(transceiver, 0, at_least, timeout_ms, out, cap, n);
}

int kvxfer_check_gen_status(uint64_t transceiver, int32_t at_least, int64_t timeout_ms, kvxfer_finished *out,
                            size_t cap, size_t *n) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_check_status(transceiver, 1, at_least, timeout_ms, out, cap, n);
}

int kvxfer_request_error(uint64_t transceiver, int32_t is_gen, uint64_t request_id, char *buf, size_t cap,
                         size_t *len) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_request_error(transceiver, is_gen, request_id, buf, cap, len);
}

int kvxfer_gen_transfer_complete(uint64_t transceiver, int32_t *complete) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_gen_transfer_complete(transceiver, complete);
}

int kvxfer_cancel(uint64_t transceiver, uint64_t request_id, int32_t *cancelled) {
    KVXFER_NOT_FORKED;
    return kvxfer_go_cancel(transceiver, request_id, cancelled);
}
