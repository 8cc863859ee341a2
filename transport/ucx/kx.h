// kx.h: the thin C layer between package ucx and UCP (UCX 1.13, *_nbx API).
//
// Every function here except kx_wake is called only from the progress
// goroutine of one Transport, one call at a time but not always from the
// same OS thread: the worker is created with UCS_THREAD_MODE_SERIALIZED.
// UCX callbacks never call into Go; they append an event to the worker's
// event list (ev[0..nev)), which Go reads from the struct after each
// progress and empties with kx_events_clear.
// Tagged requests are freed by Go when it handles their event, not in the
// callback, so that a request Go still knows of is never recycled under it
// (ucp_request_cancel on a completed, unfreed request does nothing).

#ifndef KVXFER_UCX_KX_H
#define KVXFER_UCX_KX_H

#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

// Event kinds.
enum {
	KX_EV_SEND  = 1, // a tagged send ended: id, status
	KX_EV_RECV  = 2, // a tagged receive ended: id, status, len
	KX_EV_AM    = 3, // a control message arrived: data, len (copy, freed by kx_events_clear)
	KX_EV_EPERR = 4, // an endpoint failed: id (the peer), status
	KX_EV_CTRL  = 5, // a control send ended: id, status
	KX_EV_CLOSE = 6, // an endpoint close ended: id, status
	KX_EV_DRAIN = 7, // a stale message was dropped: status, len
};

typedef struct kx_event {
	uint64_t id;
	uint64_t len;
	void    *data; // KX_EV_AM: a copy of the message
	void    *req;  // KX_EV_SEND, KX_EV_RECV: the request, for Go to free
	int32_t  status;
	int32_t  kind;
} kx_event;

typedef struct kx_worker {
	ucp_context_h ctx;
	ucp_worker_h  worker;
	int           efd; // UCX's wakeup fd (ucp_worker_get_efd)
	kx_event     *ev;
	size_t        nev, cap;
	char          scratch[256]; // where stale messages are dropped
	int           in_post;      // inside kx_tag_recv, whose id is post_id
	uint64_t      post_id;
	uint64_t      probe_tag;    // kx_unexpected_tag's answer
} kx_worker;

// The active-message id of kvxfer's control messages.
#define KX_AM_ID 0x6b78

// kx_open creates the context and worker. defaults is a NUL-separated list
// of NAME=VALUE pairs (without the UCX_ prefix) applied with
// ucp_config_modify; the caller leaves out any the environment sets.
ucs_status_t kx_open(kx_worker *w, const char *defaults, size_t defaults_len);
void         kx_close(kx_worker *w);
ucs_status_t kx_address(kx_worker *w, void **addr, size_t *len); // free with free()

unsigned kx_progress(kx_worker *w, unsigned max);
// kx_arm arms the worker for sleeping on efd: 0 armed, 1 events pending
// (progress again), -1 arming failed.
int      kx_arm(kx_worker *w);
// kx_readable reports whether fd is readable now (poll, no wait).
int      kx_readable(int fd);
// kx_wake makes efd readable (ucp_worker_signal, safe from any thread).
void     kx_wake(kx_worker *w);
// kx_unexpected_tag reports whether there is an unexpected tagged message
// (1, its tag in w->probe_tag) or not (0).
int  kx_unexpected_tag(kx_worker *w);
// kx_drain_one receives the first unexpected tagged message into scratch
// memory, truncating it (a KX_EV_DRAIN follows).
void kx_drain_one(kx_worker *w);

// kx_events_clear frees the events' copies and empties the list.
void kx_events_clear(kx_worker *w);

// kx_ep_create connects to a worker address with UCP_ERR_HANDLING_MODE_PEER;
// failures come as KX_EV_EPERR with id peer_id. *epctx is the error
// handler's argument, which kx_ep_close_force frees.
ucs_status_t kx_ep_create(kx_worker *w, const void *addr, uint64_t peer_id, ucp_ep_h *ep,
                          void **epctx);
// kx_ep_close_force closes ep, failing its requests with UCS_ERR_CANCELED;
// 1: in progress (a KX_EV_CLOSE with id follows), 0: done.
int  kx_ep_close_force(kx_worker *w, ucp_ep_h ep, void *epctx, uint64_t id);
// kx_ep_info returns ucp_ep_print_info's text (free with free()).
char *kx_ep_info(ucp_ep_h ep);

// Tagged operations: buf is a contiguous buffer of len bytes when iovcnt is
// 0, else an array of iovcnt ucp_dt_iov_t. Return UCS_INPROGRESS with *req
// set (a KX_EV_SEND/RECV with id follows), UCS_OK when done at once, or an
// error.
ucs_status_t kx_tag_send(kx_worker *w, ucp_ep_h ep, uint64_t tag, void *buf, size_t len,
                         size_t iovcnt, uint64_t id, void **req);
ucs_status_t kx_tag_recv(kx_worker *w, uint64_t tag, void *buf, size_t len, size_t iovcnt,
                         uint64_t id, void **req);
void kx_cancel(kx_worker *w, void *req);

// kx_ctrl_send sends a control message (copied). Same returns as kx_tag_send
// (a KX_EV_CTRL follows UCS_INPROGRESS).
ucs_status_t kx_ctrl_send(kx_worker *w, ucp_ep_h ep, const void *msg, size_t len, uint64_t id);

#endif
