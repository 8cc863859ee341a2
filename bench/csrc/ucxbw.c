/*
 * ucxbw: UCX's own tag-matching bandwidth between two processes of one host,
 * on memory both sides have written, the ucx_c baseline of kvxfer bench
 * (built with cc at bench time, see bench/ucxbaseline.go).
 *
 *   ucxbw SIZE WINDOW SPAN ROUNDS PAGES
 *
 * The process forks: the parent receives (as kvxfer's generation side,
 * which reads with cma from its sender), the child sends. Each maps SPAN
 * bytes of anonymous memory, 2 MiB aligned, advised MADV_HUGEPAGE when
 * PAGES is "thp" (left in 4 KiB pages when "4k"), and writes every byte of
 * it before UCX sees it (sender 0xA5, receiver 0x5A). One UCP context and
 * worker each (UCP_FEATURE_TAG, UCX_* from the environment as UCX reads it,
 * endpoints without peer error handling: as ucx_perftest runs by default),
 * worker addresses swapped over a socketpair.
 *
 * A round moves SPAN bytes as SPAN/SIZE tagged messages, message i at
 * offset i x SIZE, at most WINDOW in flight on each side (a new one posted
 * as one completes). The receiver posts its first WINDOW receives, then
 * tells the sender to go; it times the round from before posting to the
 * completion of the last receive, checks the first and last byte of every
 * message, and after ROUNDS timed rounds (one more before them, untimed,
 * warms up) prints
 *
 *   gbps=ALL best_round=BEST rounds=ROUNDS hugepages_kb=N
 *
 * ALL is the bytes of the timed rounds over their summed time, as kvxfer
 * bench computes its own figure over its measured requests; BEST is the
 * fastest round; both in 1e9 bytes per second. N is the receiver's
 * AnonHugePages after the rounds (/proc/self/smaps_rollup). Both sides
 * busy-poll ucp_worker_progress, as ucx_perftest does.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#define TAG 0x6b767862ULL /* "kvxb" */
#define HUGE (2UL << 20)

static void die(const char *what, const char *why) {
	fprintf(stderr, "ucxbw: %s: %s\n", what, why);
	exit(1);
}

static void die_status(const char *what, ucs_status_t s) { die(what, ucs_status_string(s)); }

static void xwrite(int fd, const void *p, size_t n) {
	const char *c = p;
	while (n > 0) {
		ssize_t k = write(fd, c, n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			die("write to peer", strerror(errno));
		c += k;
		n -= (size_t)k;
	}
}

static void xread(int fd, void *p, size_t n) {
	char *c = p;
	while (n > 0) {
		ssize_t k = read(fd, c, n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k == 0)
			die("read from peer", "peer closed");
		if (k < 0)
			die("read from peer", strerror(errno));
		c += k;
		n -= (size_t)k;
	}
}

static double now(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* alloc maps span bytes 2 MiB aligned, with huge-page advice when thp, and
   writes every byte with fill. */
static char *alloc(size_t span, int thp, int fill) {
	char *raw = mmap(NULL, span + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (raw == MAP_FAILED)
		die("mmap", strerror(errno));
	char *p = (char *)(((uintptr_t)raw + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
	if (madvise(p, span, thp ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0)
		die("madvise", strerror(errno));
	memset(p, fill, span);
	return p;
}

static long huge_kb(void) {
	FILE *f = fopen("/proc/self/smaps_rollup", "r");
	if (f == NULL)
		return -1;
	char line[256];
	long kb = -1;
	while (fgets(line, sizeof line, f) != NULL)
		if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1)
			break;
	fclose(f);
	return kb;
}

static void *post(int recv, ucp_worker_h w, ucp_ep_h ep, char *p, size_t size) {
	ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE, .datatype = ucp_dt_make_contig(1)};
	void *req = recv ? ucp_tag_recv_nbx(w, p, size, TAG, ~(ucp_tag_t)0, &prm) : ucp_tag_send_nbx(ep, p, size, TAG, &prm);
	if (UCS_PTR_IS_ERR(req))
		die_status(recv ? "ucp_tag_recv_nbx" : "ucp_tag_send_nbx", UCS_PTR_STATUS(req));
	return req;
}

/* round moves count messages of size bytes from buf, window at a time;
   the receiver tells the sender to go once its first receives are posted. */
static void round_trip(int recv, int sock, ucp_worker_h w, ucp_ep_h ep, char *buf, size_t size, long count, int window, void **reqs, long *msg) {
	long posted = 0, done = 0;
	int n = window < count ? window : (int)count;
	char go = 'g';
	if (!recv)
		xread(sock, &go, 1);
	for (int i = 0; i < n; i++, posted++) {
		msg[i] = posted;
		reqs[i] = post(recv, w, ep, buf + (size_t)posted * size, size);
	}
	if (recv)
		xwrite(sock, &go, 1);
	while (done < count) {
		ucp_worker_progress(w);
		for (int i = 0; i < n; i++) {
			if (msg[i] < 0)
				continue;
			if (reqs[i] != NULL) {
				ucs_status_t s = ucp_request_check_status(reqs[i]);
				if (s == UCS_INPROGRESS)
					continue;
				ucp_request_free(reqs[i]);
				if (s != UCS_OK)
					die_status(recv ? "receive" : "send", s);
			}
			done++;
			if (posted < count) {
				msg[i] = posted;
				reqs[i] = post(recv, w, ep, buf + (size_t)posted * size, size);
				posted++;
			} else {
				msg[i] = -1;
			}
		}
	}
}

int main(int argc, char **argv) {
	if (argc != 6)
		die("usage", "ucxbw SIZE WINDOW SPAN ROUNDS thp|4k");
	long size = atol(argv[1]), span = atol(argv[3]), rounds = atol(argv[4]);
	int window = atoi(argv[2]), thp = strcmp(argv[5], "thp") == 0;
	if (size <= 0 || window <= 0 || rounds <= 0 || span < size || span % size != 0)
		die("arguments", "SIZE, WINDOW and ROUNDS must be positive, SPAN a multiple of SIZE");
	if (!thp && strcmp(argv[5], "4k") != 0)
		die("arguments", "PAGES must be thp or 4k");
	long count = span / size;
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
		die("socketpair", strerror(errno));
	fflush(stdout);
	pid_t child = fork();
	if (child < 0)
		die("fork", strerror(errno));
	int recv = child != 0, sock = recv ? sv[0] : sv[1];
	close(recv ? sv[1] : sv[0]);
	if (!recv)
		prctl(PR_SET_PDEATHSIG, SIGKILL);
	char *buf = alloc((size_t)span, thp, recv ? 0x5a : 0xa5);

	ucp_config_t *cfg;
	ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
	if (s != UCS_OK)
		die_status("ucp_config_read", s);
	ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_TAG};
	ucp_context_h uctx;
	if ((s = ucp_init(&params, cfg, &uctx)) != UCS_OK)
		die_status("ucp_init", s);
	ucp_config_release(cfg);
	ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
	ucp_worker_h w;
	if ((s = ucp_worker_create(uctx, &wp, &w)) != UCS_OK)
		die_status("ucp_worker_create", s);
	ucp_address_t *addr;
	size_t alen, plen;
	if ((s = ucp_worker_get_address(w, &addr, &alen)) != UCS_OK)
		die_status("ucp_worker_get_address", s);
	xwrite(sock, &alen, sizeof alen);
	xwrite(sock, addr, alen);
	xread(sock, &plen, sizeof plen);
	void *peer = malloc(plen);
	if (peer == NULL)
		die("malloc", "out of memory");
	xread(sock, peer, plen);
	ucp_ep_params_t ep_params = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = peer};
	ucp_ep_h ep;
	if ((s = ucp_ep_create(w, &ep_params, &ep)) != UCS_OK)
		die_status("ucp_ep_create", s);

	void **reqs = calloc((size_t)window, sizeof *reqs);
	long *msg = calloc((size_t)window, sizeof *msg);
	if (reqs == NULL || msg == NULL)
		die("calloc", "out of memory");
	double best = 0, secs = 0;
	for (long r = 0; r <= rounds; r++) {
		if (recv)
			for (long i = 0; i < count; i++) /* what the check below must see replaced */
				buf[(size_t)i * (size_t)size] = buf[(size_t)(i + 1) * (size_t)size - 1] = 0x5a;
		double t0 = now();
		round_trip(recv, sock, w, ep, buf, (size_t)size, count, window, reqs, msg);
		double d = now() - t0;
		if (!recv)
			continue;
		for (long i = 0; i < count; i++) {
			const unsigned char *m = (const unsigned char *)buf + (size_t)i * (size_t)size;
			if (m[0] != 0xa5 || m[size - 1] != 0xa5) {
				fprintf(stderr, "ucxbw: message %ld of round %ld did not arrive\n", i, r);
				return 1;
			}
		}
		if (r == 0)
			continue; /* warm-up */
		secs += d;
		if ((double)span / d / 1e9 > best)
			best = (double)span / d / 1e9;
	}
	if (!recv) {
		/* Stay until the receiver has its figures: a sender's last sends
		   complete before its receiver has seen every byte. */
		char q;
		xread(sock, &q, 1);
		return 0;
	}
	printf("gbps=%.4f best_round=%.4f rounds=%ld hugepages_kb=%ld\n", (double)span * (double)rounds / secs / 1e9, best, rounds, huge_kb());
	fflush(stdout);
	xwrite(sock, "q", 1);
	int st;
	if (waitpid(child, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
		fprintf(stderr, "ucxbw: the sending process failed\n");
		return 1;
	}
	/* Endpoints, worker and context end with the process: a flushing
	   close would wait on a peer that has gone. */
	return 0;
}
