//go:build ucx && cgo

// kx.c: see kx.h.

#include "kx.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// kx_req is the user area UCP reserves with every request
// (ucp_params.request_size): what a callback needs to report the request.
// It is written right after the *_nbx call returns the request; UCX calls
// back from progress, cancel or close, which come later (a receive may
// complete inside its own call: see kx_tag_recv).
typedef struct kx_req {
	uint64_t id;
	void    *buf; // owned copy (control sends) or endpoint context (close)
} kx_req;

// kx_epctx is the argument of an endpoint's error handler.
typedef struct kx_epctx {
	kx_worker *w;
	uint64_t   id;
} kx_epctx;

static void push(kx_worker *w, int kind, uint64_t id, uint64_t len, void *data, void *req,
                 ucs_status_t st)
{
	if (w->nev == w->cap) {
		size_t    cap = w->cap ? 2 * w->cap : 64;
		kx_event *ev  = realloc(w->ev, cap * sizeof(*ev));
		if (ev == NULL) {
			// Out of memory: nothing sane is left to do for a completion
			// that cannot be reported.
			abort();
		}
		w->ev  = ev;
		w->cap = cap;
	}
	kx_event *e = &w->ev[w->nev++];
	e->kind     = kind;
	e->id       = id;
	e->len      = len;
	e->data     = data;
	e->req      = req;
	e->status   = (int32_t)st;
}

static void send_cb(void *request, ucs_status_t st, void *user)
{
	kx_req *q = request;
	push(user, KX_EV_SEND, q->id, 0, NULL, request, st);
}

static void ctrl_cb(void *request, ucs_status_t st, void *user)
{
	kx_req *q = request;
	free(q->buf);
	q->buf = NULL;
	push(user, KX_EV_CTRL, q->id, 0, NULL, NULL, st);
	ucp_request_free(request);
}

static void close_cb(void *request, ucs_status_t st, void *user)
{
	kx_req *q = request;
	free(q->buf); // the endpoint's kx_epctx
	q->buf = NULL;
	push(user, KX_EV_CLOSE, q->id, 0, NULL, NULL, st);
	ucp_request_free(request);
}

static void recv_cb(void *request, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user)
{
	kx_worker *w  = user;
	kx_req    *q  = request;
	// Called from inside kx_tag_recv (a message that was already there),
	// the request's id is not written yet.
	uint64_t   id = w->in_post ? w->post_id : q->id;
	push(w, KX_EV_RECV, id, info != NULL ? info->length : 0, NULL, request, st);
}

static void drain_cb(void *request, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user)
{
	push(user, KX_EV_DRAIN, 0, info != NULL ? info->length : 0, NULL, NULL, st);
	ucp_request_free(request);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t st)
{
	kx_epctx *c = arg;
	(void)ep;
	push(c->w, KX_EV_EPERR, c->id, 0, NULL, NULL, st);
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param)
{
	kx_worker *w = arg;
	(void)header;
	(void)header_length;
	// Control messages are small and sent eagerly; anything else is not
	// ours to keep (returning UCS_OK drops a rendezvous descriptor).
	if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length > 65536) {
		return UCS_OK;
	}
	void *copy = malloc(length ? length : 1);
	if (copy == NULL) {
		return UCS_OK;
	}
	memcpy(copy, data, length);
	push(w, KX_EV_AM, 0, length, copy, NULL, UCS_OK);
	return UCS_OK;
}

static void req_init(void *request)
{
	memset(request, 0, sizeof(kx_req));
}

ucs_status_t kx_open(kx_worker *w, const char *defaults, size_t defaults_len)
{
	ucp_config_t *cfg;
	ucs_status_t  st;

	w->efd = -1;
	st     = ucp_config_read(NULL, NULL, &cfg);
	if (st != UCS_OK) {
		return st;
	}
	// defaults: "NAME=VALUE\0NAME=VALUE\0..."
	for (size_t off = 0; off < defaults_len;) {
		const char *kv  = defaults + off;
		size_t      n   = strlen(kv);
		const char *eq  = strchr(kv, '=');
		off            += n + 1;
		if (eq == NULL || eq == kv) {
			continue;
		}
		char name[128];
		size_t nl = (size_t)(eq - kv);
		if (nl >= sizeof(name)) {
			continue;
		}
		memcpy(name, kv, nl);
		name[nl] = 0;
		st       = ucp_config_modify(cfg, name, eq + 1);
		if (st != UCS_OK) {
			ucp_config_release(cfg);
			return st;
		}
	}

	ucp_params_t p = {0};
	p.field_mask   = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE |
	                 UCP_PARAM_FIELD_REQUEST_INIT | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
	                 UCP_PARAM_FIELD_NAME;
	p.features          = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
	p.request_size      = sizeof(kx_req);
	p.request_init      = req_init;
	p.mt_workers_shared = 0;
	p.name              = "kvxfer";
	st                  = ucp_init(&p, cfg, &w->ctx);
	ucp_config_release(cfg);
	if (st != UCS_OK) {
		return st;
	}

	ucp_worker_params_t wp = {0};
	wp.field_mask          = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	wp.thread_mode         = UCS_THREAD_MODE_SERIALIZED;
	st                     = ucp_worker_create(w->ctx, &wp, &w->worker);
	if (st != UCS_OK) {
		goto err_ctx;
	}
	st = ucp_worker_get_efd(w->worker, &w->efd);
	if (st != UCS_OK) {
		goto err_worker;
	}

	ucp_am_handler_param_t ap = {0};
	ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
	                UCP_AM_HANDLER_PARAM_FIELD_ARG;
	ap.id  = KX_AM_ID;
	ap.cb  = am_cb;
	ap.arg = w;
	st     = ucp_worker_set_am_recv_handler(w->worker, &ap);
	if (st != UCS_OK) {
		goto err_worker;
	}
	return UCS_OK;

err_worker:
	ucp_worker_destroy(w->worker);
	w->worker = NULL;
err_ctx:
	ucp_cleanup(w->ctx);
	w->ctx = NULL;
	return st;
}

void kx_close(kx_worker *w)
{
	if (w->worker != NULL) {
		ucp_worker_destroy(w->worker);
		w->worker = NULL;
	}
	if (w->ctx != NULL) {
		ucp_cleanup(w->ctx);
		w->ctx = NULL;
	}
	kx_events_clear(w);
	free(w->ev);
	w->ev  = NULL;
	w->cap = 0;
}

ucs_status_t kx_address(kx_worker *w, void **addr, size_t *len)
{
	ucp_address_t *a;
	ucs_status_t   st = ucp_worker_get_address(w->worker, &a, len);
	if (st != UCS_OK) {
		return st;
	}
	*addr = malloc(*len);
	if (*addr == NULL) {
		ucp_worker_release_address(w->worker, a);
		return UCS_ERR_NO_MEMORY;
	}
	memcpy(*addr, a, *len);
	ucp_worker_release_address(w->worker, a);
	return UCS_OK;
}

unsigned kx_progress(kx_worker *w, unsigned max)
{
	unsigned total = 0;
	for (unsigned i = 0; i < max; i++) {
		unsigned n = ucp_worker_progress(w->worker);
		if (n == 0) {
			break;
		}
		total += n;
	}
	return total;
}

int kx_arm(kx_worker *w)
{
	ucs_status_t st = ucp_worker_arm(w->worker);
	if (st == UCS_ERR_BUSY) {
		return 1;
	}
	return st == UCS_OK ? 0 : -1;
}

int kx_readable(int fd)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	return poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
}

void kx_wake(kx_worker *w)
{
	ucp_worker_signal(w->worker);
}

int kx_unexpected_tag(kx_worker *w)
{
	ucp_tag_recv_info_t info;
	if (ucp_tag_probe_nb(w->worker, 0, 0, 0, &info) == NULL) {
		return 0;
	}
	w->probe_tag = info.sender_tag;
	return 1;
}

void kx_drain_one(kx_worker *w)
{
	ucp_tag_recv_info_t info;
	ucp_tag_message_h   m = ucp_tag_probe_nb(w->worker, 0, 0, 1, &info);
	if (m == NULL) {
		return;
	}
	ucp_request_param_t p = {0};
	p.op_attr_mask        = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
	                        UCP_OP_ATTR_FIELD_RECV_INFO;
	p.cb.recv             = drain_cb;
	p.user_data           = w;
	p.recv_info.tag_info  = &info;
	void *r = ucp_tag_msg_recv_nbx(w->worker, w->scratch, sizeof(w->scratch), m, &p);
	if (UCS_PTR_IS_PTR(r)) {
		kx_req *q = r;
		q->id     = 0;
		q->buf    = NULL;
	} else {
		push(w, KX_EV_DRAIN, 0, info.length, NULL, NULL, UCS_PTR_STATUS(r));
	}
}

void kx_events_clear(kx_worker *w)
{
	for (size_t i = 0; i < w->nev; i++) {
		free(w->ev[i].data);
	}
	w->nev = 0;
}

ucs_status_t kx_ep_create(kx_worker *w, const void *addr, uint64_t peer_id, ucp_ep_h *ep,
                          void **epctx)
{
	kx_epctx *c = malloc(sizeof(*c));
	if (c == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	c->w  = w;
	c->id = peer_id;

	ucp_ep_params_t p = {0};
	p.field_mask      = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
	                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.address        = addr;
	p.err_mode       = UCP_ERR_HANDLING_MODE_PEER;
	p.err_handler.cb = ep_err_cb;
	p.err_handler.arg = c;
	ucs_status_t st  = ucp_ep_create(w->worker, &p, ep);
	if (st != UCS_OK) {
		free(c);
		return st;
	}
	*epctx = c;
	return UCS_OK;
}

int kx_ep_close_force(kx_worker *w, ucp_ep_h ep, void *epctx, uint64_t id)
{
	ucp_request_param_t p = {0};
	p.op_attr_mask        = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
	                        UCP_OP_ATTR_FIELD_USER_DATA;
	p.flags               = UCP_EP_CLOSE_FLAG_FORCE;
	p.cb.send             = close_cb;
	p.user_data           = w;
	void *r = ucp_ep_close_nbx(ep, &p);
	if (UCS_PTR_IS_PTR(r)) {
		kx_req *q = r;
		q->id     = id;
		q->buf    = epctx; // freed by close_cb: UCX may still report to it until then
		return 1;
	}
	free(epctx);
	return 0;
}

char *kx_ep_info(ucp_ep_h ep)
{
	char  *buf = NULL;
	size_t n   = 0;
	FILE  *f   = open_memstream(&buf, &n);
	if (f == NULL) {
		return NULL;
	}
	ucp_ep_print_info(ep, f);
	fclose(f);
	return buf;
}

ucs_status_t kx_tag_send(kx_worker *w, ucp_ep_h ep, uint64_t tag, void *buf, size_t len,
                         size_t iovcnt, uint64_t id, void **req)
{
	ucp_request_param_t p = {0};
	p.op_attr_mask        = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
	p.cb.send             = send_cb;
	p.user_data           = w;
	size_t count          = len;
	if (iovcnt > 0) {
		p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
		p.datatype      = ucp_dt_make_iov();
		count           = iovcnt;
	}
	void *r = ucp_tag_send_nbx(ep, buf, count, tag, &p);
	if (r == NULL) {
		return UCS_OK;
	}
	if (UCS_PTR_IS_ERR(r)) {
		return UCS_PTR_STATUS(r);
	}
	kx_req *q = r;
	q->id     = id;
	q->buf    = NULL;
	*req      = r;
	return UCS_INPROGRESS;
}

ucs_status_t kx_tag_recv(kx_worker *w, uint64_t tag, void *buf, size_t len, size_t iovcnt,
                         uint64_t id, void **req)
{
	ucp_request_param_t p = {0};
	// No immediate completion: UCX 1.13 does not fill recv_info then, and
	// the length must be checked. The callback may run inside the call.
	p.op_attr_mask        = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
	                        UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
	p.cb.recv             = recv_cb;
	p.user_data           = w;
	size_t count          = len;
	if (iovcnt > 0) {
		p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
		p.datatype      = ucp_dt_make_iov();
		count           = iovcnt;
	}
	w->in_post = 1;
	w->post_id = id;
	void *r    = ucp_tag_recv_nbx(w->worker, buf, count, tag, (ucp_tag_t)-1, &p);
	w->in_post = 0;
	if (UCS_PTR_IS_ERR(r)) {
		return UCS_PTR_STATUS(r);
	}
	if (r == NULL) { // not expected with NO_IMM_CMPL
		push(w, KX_EV_RECV, id, len, NULL, NULL, UCS_OK);
		return UCS_OK;
	}
	kx_req *q = r;
	q->id     = id;
	q->buf    = NULL;
	*req      = r;
	return UCS_INPROGRESS;
}

void kx_cancel(kx_worker *w, void *req)
{
	ucp_request_cancel(w->worker, req);
}

ucs_status_t kx_ctrl_send(kx_worker *w, ucp_ep_h ep, const void *msg, size_t len, uint64_t id)
{
	void *copy = malloc(len ? len : 1);
	if (copy == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	memcpy(copy, msg, len);
	ucp_request_param_t p = {0};
	p.op_attr_mask        = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
	                        UCP_OP_ATTR_FIELD_FLAGS;
	p.cb.send             = ctrl_cb;
	p.user_data           = w;
	p.flags               = UCP_AM_SEND_FLAG_EAGER;
	void *r = ucp_am_send_nbx(ep, KX_AM_ID, NULL, 0, copy, len, &p);
	if (!UCS_PTR_IS_PTR(r)) {
		free(copy);
		return UCS_PTR_STATUS(r);
	}
	kx_req *q = r;
	q->id     = id;
	q->buf    = copy;
	return UCS_INPROGRESS;
}
