/*
 * transfer.c: two processes move a KV cache through libkvxfer, bit-exact.
 *
 *   ./transfer            the generation instance (TP1, on its own memory):
 *                         starts the context instance as a child process,
 *                         reads the opaque state from it, pulls the request,
 *                         checks every byte
 *   ./transfer context    the context instance (TP1, on a pool kvxfer
 *                         allocates): fills a request's blocks, hands them
 *                         to its transceiver, prints the opaque state (hex)
 *                         and waits until the pull has finished
 *
 * Build: gcc -Iinclude examples/c/transfer.c -Llib -lkvxfer -Wl,-rpath,'$ORIGIN/../lib' -o bin/transfer
 * (make test-lib builds and runs it).
 */
#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvxfer.h"

extern char **environ;

/* A small Llama-like model: 4 layers, 8 KV heads of 64 bf16 values, 16
 * tokens per block: 64 KiB blocks at TP1. */
static kvxfer_cache_state model(void) {
    kvxfer_cache_state s = {0};
    s.struct_size = sizeof s;
    s.layers = 4;
    s.kv_heads = 8;
    s.head_dim = 64;
    s.tokens_per_block = 16;
    s.dtype = KVXFER_DTYPE_BF16;
    s.attention = KVXFER_ATTENTION_DEFAULT;
    s.tp = 1;
    s.pp = 1;
    return s;
}

static const char config_yaml[] =
    "cache_transceiver_config:\n"
    "  backend: TCP\n"
    "  kv_transfer_timeout_ms: 20000\n";

enum { NUM_BLOCKS = 8, REQ_BLOCKS = 3, TOKENS = 40, REQUEST_ID = 42 };

/* The byte at offset j of the request's k-th block. */
static uint8_t pattern(int k, uint64_t j) {
    uint64_t h = (uint64_t)(k + 1) * 0x9e3779b97f4a7c15ull ^ (j + 1) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
    return (uint8_t)(h * 0x94d049bb133111ebull >> 56);
}

static int fail(const char *what, int rc) {
    fprintf(stderr, "transfer: %s: %d: %s\n", what, rc, kvxfer_last_error());
    return 1;
}

static int open_rank(kvxfer_pool *pool, uint64_t *t) {
    uint64_t cfg;
    int rc = kvxfer_config_load_yaml(config_yaml, strlen(config_yaml), "example.yaml", &cfg);
    if (rc != KVXFER_OK) return fail("config", rc);
    kvxfer_cache_state s = model();
    rc = kvxfer_transceiver_create(cfg, &s, NULL, 0, pool, NULL, NULL, t);
    kvxfer_config_free(cfg);
    if (rc != KVXFER_OK) return fail("create", rc);
    return 0;
}

static int context_side(void) {
    kvxfer_pool pool = {.base = NULL, .num_blocks = NUM_BLOCKS}; /* kvxfer allocates it */
    uint64_t t;
    if (open_rank(&pool, &t)) return 1;
    const int32_t blocks[REQ_BLOCKS] = {3, 1, 4};
    for (int k = 0; k < REQ_BLOCKS; k++) {
        uint8_t *b = (uint8_t *)pool.base + (uint64_t)blocks[k] * pool.block_bytes;
        for (uint64_t j = 0; j < pool.block_bytes; j++) b[j] = pattern(k, j);
    }
    uint8_t opaque[4096];
    size_t n;
    int rc = kvxfer_respond_and_send(t, REQUEST_ID, 0, TOKENS, blocks, REQ_BLOCKS, opaque, sizeof opaque, &n);
    if (rc != KVXFER_OK) return fail("respond", rc);
    if (n > sizeof opaque) return fail("opaque state larger than the buffer", 0);
    for (size_t i = 0; i < n; i++) printf("%02x", opaque[i]);
    printf("\n");
    fflush(stdout);

    kvxfer_finished done[4];
    rc = kvxfer_check_context_status(t, 1, 20000, done, 4, &n);
    if (rc != KVXFER_OK) return fail("context status", rc);
    if (n != 1 || done[0].request_id != REQUEST_ID || done[0].status != KVXFER_OK) {
        fprintf(stderr, "transfer: context: request %" PRIu64 " ended with %d\n", done[0].request_id, done[0].status);
        return 1;
    }
    char line[16];
    if (!fgets(line, sizeof line, stdin)) fprintf(stderr, "transfer: context: parent gone\n");
    rc = kvxfer_transceiver_close(t);
    return rc == KVXFER_OK ? 0 : fail("close", rc);
}

static int generation_side(const char *self) {
    uint64_t bb;
    kvxfer_cache_state s = model();
    int rc = kvxfer_block_bytes(&s, 0, &bb);
    if (rc != KVXFER_OK) return fail("block bytes", rc);
    uint8_t *mem = calloc(NUM_BLOCKS, bb); /* the engine's own memory */
    kvxfer_pool pool = {.base = mem, .size = NUM_BLOCKS * bb, .num_blocks = NUM_BLOCKS, .block_bytes = bb};
    uint64_t t;
    if (open_rank(&pool, &t)) return 1;

    int to_child[2], from_child[2];
    if (pipe(to_child) || pipe(from_child)) return fail("pipe", 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
    posix_spawn_file_actions_addclose(&fa, to_child[1]);
    posix_spawn_file_actions_addclose(&fa, from_child[0]);
    char *argv[] = {(char *)self, "context", NULL};
    pid_t child;
    if (posix_spawn(&child, self, &fa, NULL, argv, environ) != 0) return fail("spawn the context process", 0);
    close(to_child[0]);
    close(from_child[1]);

    FILE *in = fdopen(from_child[0], "r");
    char hex[8192];
    if (!fgets(hex, sizeof hex, in)) return fail("no opaque state from the context process", 0);
    uint8_t opaque[4096];
    size_t n = 0;
    for (char *p = hex; p[0] && p[1] && p[0] != '\n' && n < sizeof opaque; p += 2) sscanf(p, "%2hhx", &opaque[n++]);

    const int32_t blocks[REQ_BLOCKS] = {7, 0, 2};
    rc = kvxfer_request_and_receive_sync(t, 1, 0, TOKENS, opaque, n, blocks, REQ_BLOCKS, 20000);
    if (rc != KVXFER_OK) return fail("receive", rc);
    uint64_t bad = 0;
    for (int k = 0; k < REQ_BLOCKS; k++) {
        const uint8_t *b = mem + (uint64_t)blocks[k] * bb;
        for (uint64_t j = 0; j < bb; j++) bad += b[j] != pattern(k, j);
    }
    if (write(to_child[1], "done\n", 5) != 5) fprintf(stderr, "transfer: context process gone\n");
    close(to_child[1]);
    int status;
    waitpid(child, &status, 0);
    kvxfer_transceiver_close(t);
    free(mem); /* the caller's memory: kvxfer is done with it once closed */
    if (bad) {
        fprintf(stderr, "transfer: %" PRIu64 " bytes differ\n", bad);
        return 1;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "transfer: the context process failed\n");
        return 1;
    }
    printf("transfer: %d blocks of %" PRIu64 " bytes moved bit-exact between two processes (ABI %u)\n",
           REQ_BLOCKS, bb, kvxfer_abi_version());
    return 0;
}

int main(int argc, char **argv) {
    if (kvxfer_abi_version() != KVXFER_ABI_VERSION) {
        fprintf(stderr, "transfer: library ABI %u, header %d\n", kvxfer_abi_version(), KVXFER_ABI_VERSION);
        return 1;
    }
    if (argc > 1 && strcmp(argv[1], "context") == 0) return context_side();
    return generation_side(argv[0]);
}
