//go:build cgo

// Command libkvxfer is kvxfer's C ABI, built with
// go build -buildmode=c-shared (make lib: lib/libkvxfer.so); the ABI is
// include/kvxfer.h. It is thin: each exported function turns C arguments
// into Go values, calls package internal/capi, and turns the error into a
// kvxfer_status and the thread's last-error message. The public C symbols
// are shim.c's, which refuse a forked child before entering Go.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#include <stddef.h>
#include <stdint.h>
#include "kvxfer.h"
void kvxfer_shim_set_error(const char *msg, size_t len);
*/
import "C"

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"strings"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/buildinfo"
	"github.com/kvxfer/kvxfer/internal/capi"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

func main() {}

var (
	configs      = capi.NewTable[*capi.Config]("config")
	transceivers = capi.NewTable[*capi.Transceiver]("transceiver")
	logger       = newLogger()
)

// newLogger logs to stderr at KVXFER_LOG_LEVEL (default warn). A value
// that is not a level is said, once, rather than taken silently for warn.
func newLogger() *slog.Logger {
	var lvl slog.Level = slog.LevelWarn
	v, set := os.LookupEnv("KVXFER_LOG_LEVEL")
	bad := set && lvl.UnmarshalText([]byte(v)) != nil
	if bad {
		lvl = slog.LevelWarn
	}
	l := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})).With("lib", "kvxfer", "pid", os.Getpid())
	if bad {
		l.Warn("KVXFER_LOG_LEVEL is not a level: want debug, info, warn or error; logging at warn", "KVXFER_LOG_LEVEL", v)
	}
	return l
}

// ret turns err into a status and, for an error, the thread's message. A
// panic (a bug) becomes KVXFER_ERR_INTERNAL rather than a crash of the
// caller's process.
func ret(err error) C.int {
	if err == nil {
		return C.int(capi.OK)
	}
	msg := err.Error()
	C.kvxfer_shim_set_error((*C.char)(unsafe.Pointer(unsafe.StringData(msg))), C.size_t(len(msg)))
	return C.int(capi.CodeOf(err))
}

func guard(fn func() error) (rc C.int) {
	defer func() {
		if p := recover(); p != nil {
			rc = ret(&capi.Error{Code: capi.CodeInternal, Err: fmt.Errorf("kvxfer: internal error (a bug, please report it): %v", p)})
		}
	}()
	return ret(fn())
}

func null(what string) error {
	return &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: %s is NULL", what)}
}

// writeOut copies b into the caller's buffer of cap bytes (plus a NUL when
// nul), setting *n to len(b); too small: KVXFER_ERR_BUFFER_TOO_SMALL.
func writeOut(what string, b []byte, buf unsafe.Pointer, capacity C.size_t, n *C.size_t, nul bool) error {
	if n == nil {
		return null(what + " length")
	}
	*n = C.size_t(len(b))
	need := len(b)
	if nul {
		need++
	}
	if int(capacity) < need || buf == nil {
		return &capi.Error{Code: capi.CodeBufferTooSmall, Err: fmt.Errorf("kvxfer: %s needs %d bytes, the buffer has %d", what, need, capacity)}
	}
	dst := unsafe.Slice((*byte)(buf), need)
	copy(dst, b)
	if nul {
		dst[len(b)] = 0
	}
	return nil
}

//export kvxfer_go_version
func kvxfer_go_version(buf *C.char, capacity C.size_t, n *C.size_t) C.int {
	return guard(func() error {
		in := buildinfo.Read()
		return writeOut("version", []byte("kvxfer "+in.Revision), unsafe.Pointer(buf), capacity, n, true)
	})
}

func env() config.Env { return config.LoadEnv(os.LookupEnv, os.Environ()) }

//export kvxfer_go_config_load_yaml
func kvxfer_go_config_load_yaml(text *C.char, n C.size_t, name *C.char, out *C.uint64_t) C.int {
	return guard(func() error {
		if text == nil || out == nil {
			return null("text or config")
		}
		if n > config.MaxFileSize {
			// config.LoadBytes refuses it with its own message; copy no more.
			n = config.MaxFileSize + 1
		}
		nm := "config"
		if name != nil {
			nm = C.GoString(name)
		}
		c, err := capi.LoadConfig(nm, C.GoBytes(unsafe.Pointer(text), C.int(n)), env())
		if err != nil {
			return err
		}
		for _, w := range c.Warnings() {
			logger.Warn("config", "warning", w)
		}
		*out = C.uint64_t(configs.Put(c))
		return nil
	})
}

//export kvxfer_go_config_load_file
func kvxfer_go_config_load_file(path *C.char, out *C.uint64_t) C.int {
	return guard(func() error {
		if path == nil || out == nil {
			return null("path or config")
		}
		c, err := capi.LoadConfig(C.GoString(path), nil, env())
		if err != nil {
			return err
		}
		for _, w := range c.Warnings() {
			logger.Warn("config", "warning", w)
		}
		*out = C.uint64_t(configs.Put(c))
		return nil
	})
}

//export kvxfer_go_config_free
func kvxfer_go_config_free(h C.uint64_t) C.int {
	configs.Delete(uint64(h))
	return C.int(capi.OK)
}

// stateDesc reads a kvxfer_cache_state.
func stateDesc(s *C.kvxfer_cache_state) (capi.StateDesc, error) {
	if s == nil {
		return capi.StateDesc{}, null("state")
	}
	if uintptr(s.struct_size) < unsafe.Sizeof(*s) {
		return capi.StateDesc{}, &capi.Error{Code: capi.CodeInvalidArgument,
			Err: fmt.Errorf("kvxfer: state.struct_size is %d, this library's kvxfer_cache_state has %d bytes (set it to sizeof(kvxfer_cache_state))", s.struct_size, unsafe.Sizeof(*s))}
	}
	d := capi.StateDesc{Layers: int(s.layers), KVHeads: int(s.kv_heads), HeadDim: int(s.head_dim), TokensPerBlock: int(s.tokens_per_block),
		KVFactor: int(s.kv_factor), DType: kvcache.DType(s.dtype), Attention: layout.AttentionType(s.attention),
		TP: int(s.tp), PP: int(s.pp), AttentionDP: s.attention_dp != 0, DPSize: int(s.dp_size)}
	if s.dtype < 0 || s.dtype > 255 || s.attention < 0 || s.attention > 255 {
		return d, &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: state: dtype %d or attention %d out of range", s.dtype, s.attention)}
	}
	if s.layers_per_pp != nil && s.pp > 0 && s.pp <= 1<<12 {
		for _, v := range unsafe.Slice((*int32)(unsafe.Pointer(s.layers_per_pp)), int(s.pp)) {
			d.LayersPerPP = append(d.LayersPerPP, int(v))
		}
	}
	return d, nil
}

//export kvxfer_go_block_bytes
func kvxfer_go_block_bytes(s *C.kvxfer_cache_state, rank C.int32_t, out *C.uint64_t) C.int {
	return guard(func() error {
		d, err := stateDesc(s)
		if err != nil {
			return err
		}
		st, err := d.CacheState()
		if err != nil {
			return err
		}
		if out == nil {
			return null("block_bytes")
		}
		if rank < 0 || int(rank) >= st.Parallel.NumRanks() {
			return &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: rank %d out of range [0,%d) of %s", rank, st.Parallel.NumRanks(), st.Parallel)}
		}
		*out = C.uint64_t(st.RankLayout(int(rank)).BlockBytes())
		return nil
	})
}

//export kvxfer_go_transceiver_create
func kvxfer_go_transceiver_create(ch C.uint64_t, s *C.kvxfer_cache_state, ranks *C.int32_t, nRanks C.size_t, pools *C.kvxfer_pool, group *C.kvxfer_group, host *C.char, out *C.uint64_t) C.int {
	return guard(func() error {
		c, err := configs.Get(uint64(ch))
		if err != nil {
			return err
		}
		d, err := stateDesc(s)
		if err != nil {
			return err
		}
		st, err := d.CacheState()
		if err != nil {
			return err
		}
		if out == nil || pools == nil {
			return null("transceiver or pools")
		}
		o := capi.Options{State: d, Logger: logger}
		if o.Ranks, err = hostedRanks(ranks, nRanks, st.Parallel.NumRanks()); err != nil {
			return err
		}
		hosted := st.Parallel.NumRanks()
		if len(o.Ranks) > 0 {
			hosted = len(o.Ranks)
		}
		ps := unsafe.Slice(pools, hosted)
		if o.Pools, err = poolSpecs(ps); err != nil {
			return err
		}
		join := 60 * time.Second
		if group != nil {
			if o.Group, join, err = groupSpec(group, join); err != nil {
				return err
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), join)
		defer cancel()
		if h := C.GoString(host); host != nil && h != "" {
			o.ListenHost = h
		}
		t, err := capi.Open(ctx, c, o)
		if err != nil {
			return err
		}
		returnPools(ps, t, o.Ranks, st)
		*out = C.uint64_t(transceivers.Put(t))
		logger.Info("transceiver open", "handle", uint64(*out), "state", st.Parallel.String(), "endpoints", strings.Join(t.Endpoints(), ","))
		return nil
	})
}

// hostedRanks are the ranks listed in C's ranks[nRanks], of an instance
// of n ranks; none (every rank hosted) when the list is empty. ranks NULL
// with a count is refused: it is no list, and taking it for every rank
// would open ranks the caller did not mean to host.
func hostedRanks(ranks *C.int32_t, nRanks C.size_t, n int) ([]int, error) {
	if ranks == nil && nRanks > 0 {
		return nil, &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: ranks is NULL and n_ranks is %d (NULL and 0: every rank)", uint64(nRanks))}
	}
	if nRanks == 0 {
		return nil, nil
	}
	if uint64(nRanks) > uint64(n) {
		return nil, &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: n_ranks is %d, the instance has %d ranks", uint64(nRanks), n)}
	}
	var hosted []int
	for _, r := range unsafe.Slice((*int32)(unsafe.Pointer(ranks)), int(nRanks)) {
		hosted = append(hosted, int(r))
	}
	return hosted, nil
}

// poolSpecs are the pools C's ps describe, one per hosted rank: the
// caller's memory where base is set, else kvxfer's to map.
func poolSpecs(ps []C.kvxfer_pool) ([]capi.PoolSpec, error) {
	var specs []capi.PoolSpec
	for i := range ps {
		p := &ps[i]
		spec := capi.PoolSpec{NumBlocks: int(p.num_blocks), BlockBytes: int64(p.block_bytes)}
		if p.base != nil {
			if p.size == 0 || uint64(p.size) > math.MaxInt {
				return nil, &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: pools[%d]: base set, size %d (want 1..%d)", i, uint64(p.size), math.MaxInt)}
			}
			spec.Memory = unsafe.Slice((*byte)(p.base), int(p.size))
		}
		specs = append(specs, spec)
	}
	return specs, nil
}

// groupSpec is the process group C's group describes, and the time to
// join it: the group's join timeout when set, else join.
func groupSpec(group *C.kvxfer_group, join time.Duration) (capi.GroupSpec, time.Duration, error) {
	if uintptr(group.struct_size) < unsafe.Sizeof(*group) {
		return capi.GroupSpec{}, join, &capi.Error{Code: capi.CodeInvalidArgument,
			Err: fmt.Errorf("kvxfer: group.struct_size is %d, this library's kvxfer_group has %d bytes (set it to sizeof(kvxfer_group))", group.struct_size, unsafe.Sizeof(*group))}
	}
	g := capi.GroupSpec{Mode: capi.GroupMode(group.mode), Process: int(group.process), Processes: int(group.processes)}
	if group.coordinator != nil {
		g.Coordinator = C.GoString(group.coordinator)
	}
	if group.join_timeout_ms > 0 {
		join = time.Duration(group.join_timeout_ms) * time.Millisecond
	}
	return g, join, nil
}

// returnPools tells C, in ps, each hosted rank's block size (ranks
// listed, or every rank) and, for a pool it did not give, kvxfer's
// mapping of t.
func returnPools(ps []C.kvxfer_pool, t *capi.Transceiver, ranks []int, st layout.CacheState) {
	for i := range ps {
		mem := t.PoolMemory(i)
		rank := i
		if len(ranks) > 0 {
			rank = ranks[i]
		}
		ps[i].block_bytes = C.uint64_t(st.RankLayout(rank).BlockBytes())
		if ps[i].base == nil {
			// kvxfer's mapping (not Go memory): C may hold it until close.
			ps[i].base, ps[i].size = unsafe.Pointer(unsafe.SliceData(mem)), C.uint64_t(len(mem))
		}
	}
}

//export kvxfer_go_transceiver_close
func kvxfer_go_transceiver_close(h C.uint64_t) C.int {
	return guard(func() error {
		t, ok := transceivers.Delete(uint64(h))
		if !ok {
			return nil
		}
		return t.Close()
	})
}

// blockIDs reads n_hosted*n block ids, hosted rank by hosted rank.
func blockIDs(t *capi.Transceiver, ids *C.int32_t, n C.size_t) ([][]kvcache.BlockID, error) {
	hosted := len(t.Ranks())
	if ids == nil && n > 0 {
		return nil, null("block_ids")
	}
	if n > kvcache.MaxBlocks {
		return nil, &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: %d blocks per rank, at most %d", n, kvcache.MaxBlocks)}
	}
	var all []int32
	if n > 0 {
		all = unsafe.Slice((*int32)(unsafe.Pointer(ids)), hosted*int(n))
	}
	out := make([][]kvcache.BlockID, hosted)
	for i := range out {
		out[i] = make([]kvcache.BlockID, n)
		for k := range out[i] {
			out[i][k] = kvcache.BlockID(all[i*int(n)+k])
		}
	}
	return out, nil
}

//export kvxfer_go_respond_and_send
func kvxfer_go_respond_and_send(h, id C.uint64_t, dp, tokens C.int32_t, ids *C.int32_t, n C.size_t, opaque *C.uint8_t, capacity C.size_t, opaqueLen *C.size_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		if opaqueLen == nil {
			return null("opaque_len")
		}
		bs, err := blockIDs(t, ids, n)
		if err != nil {
			return err
		}
		op, err := t.RespondAndSend(uint64(id), int(dp), int(tokens), bs)
		if err != nil {
			return err
		}
		*opaqueLen = C.size_t(len(op))
		if opaque != nil && int(capacity) >= len(op) {
			copy(unsafe.Slice((*byte)(unsafe.Pointer(opaque)), len(op)), op)
		}
		return nil
	})
}

//export kvxfer_go_context_opaque_state
func kvxfer_go_context_opaque_state(h, id C.uint64_t, opaque *C.uint8_t, capacity C.size_t, opaqueLen *C.size_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		op, err := t.OpaqueState(uint64(id))
		if err != nil {
			return err
		}
		return writeOut("opaque state", op, unsafe.Pointer(opaque), capacity, opaqueLen, false)
	})
}

//export kvxfer_go_request_and_receive
func kvxfer_go_request_and_receive(h, id C.uint64_t, dp, tokens C.int32_t, opaque *C.uint8_t, opaqueLen C.size_t, ids *C.int32_t, n C.size_t, sync C.int, timeoutMS C.int64_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		if opaque == nil && opaqueLen > 0 {
			return null("opaque")
		}
		if opaqueLen > maxOpaque {
			return &capi.Error{Code: capi.CodeBadOpaqueState, Err: fmt.Errorf("kvxfer: an opaque state of %d bytes: at most %d", opaqueLen, maxOpaque)}
		}
		op := C.GoBytes(unsafe.Pointer(opaque), C.int(opaqueLen))
		bs, err := blockIDs(t, ids, n)
		if err != nil {
			return err
		}
		if sync == 0 {
			return t.RequestAndReceive(uint64(id), int(dp), int(tokens), op, bs)
		}
		ctx, cancel := withTimeout(timeoutMS)
		defer cancel()
		return t.RequestAndReceiveSync(ctx, uint64(id), int(dp), int(tokens), op, bs)
	})
}

// maxOpaque bounds the opaque states the receive calls copy: far above any
// real one (a few hundred bytes per rank).
const maxOpaque = 1 << 20

func withTimeout(ms C.int64_t) (context.Context, context.CancelFunc) {
	if ms < 0 {
		return context.WithCancel(context.Background())
	}
	return context.WithTimeout(context.Background(), time.Duration(ms)*time.Millisecond)
}

//export kvxfer_go_check_status
func kvxfer_go_check_status(h C.uint64_t, gen C.int, atLeast C.int32_t, timeoutMS C.int64_t, out *C.kvxfer_finished, capacity C.size_t, n *C.size_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		if n == nil || (out == nil && capacity > 0) {
			return null("out or n")
		}
		*n = 0
		ctx, cancel := withTimeout(timeoutMS)
		defer cancel()
		check := t.CheckContextStatus
		if gen != 0 {
			check = t.CheckGenStatus
		}
		got, werr := check(ctx, int(atLeast), int(min(capacity, 1<<30)))
		if len(got) > 0 {
			dst := unsafe.Slice(out, len(got))
			for i, f := range got {
				dst[i].request_id, dst[i].status = C.uint64_t(f.ID), C.int32_t(f.Code)
			}
		}
		*n = C.size_t(len(got))
		return werr
	})
}

//export kvxfer_go_request_error
func kvxfer_go_request_error(h C.uint64_t, gen C.int32_t, id C.uint64_t, buf *C.char, capacity C.size_t, n *C.size_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		rerr := t.RequestError(gen != 0, uint64(id))
		if capi.CodeOf(rerr) == capi.CodeNotFound {
			return rerr
		}
		return writeOut("request error", []byte(rerr.Error()), unsafe.Pointer(buf), capacity, n, true)
	})
}

//export kvxfer_go_gen_transfer_complete
func kvxfer_go_gen_transfer_complete(h C.uint64_t, complete *C.int32_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		if complete == nil {
			return null("complete")
		}
		*complete = 0
		if t.GenTransferComplete() {
			*complete = 1
		}
		return nil
	})
}

//export kvxfer_go_cancel
func kvxfer_go_cancel(h, id C.uint64_t, cancelled *C.int32_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		ok := t.Cancel(uint64(id))
		if cancelled != nil {
			*cancelled = 0
			if ok {
				*cancelled = 1
			}
		}
		return nil
	})
}

//export kvxfer_go_group_outbox
func kvxfer_go_group_outbox(h C.uint64_t, buf *C.uint8_t, capacity C.size_t, n *C.size_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		b, err := t.Outbox()
		if err != nil {
			return err
		}
		if err := writeOut("group contribution", b, unsafe.Pointer(buf), capacity, n, false); err != nil {
			return err
		}
		t.HandedOut()
		return nil
	})
}

//export kvxfer_go_group_deliver
func kvxfer_go_group_deliver(h C.uint64_t, flat *C.uint8_t, lens *C.size_t, n C.size_t) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		if lens == nil || n == 0 || n > 1<<16 {
			return &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: group deliver: %d contributions (lens %v)", n, lens != nil)}
		}
		ls := unsafe.Slice((*C.size_t)(lens), int(n))
		total := 0
		for i, l := range ls {
			if uint64(l) > uint64(math.MaxInt-total) {
				return &capi.Error{Code: capi.CodeInvalidArgument, Err: fmt.Errorf("kvxfer: group deliver: lens[%d] is %d: the contributions add up past any buffer", i, uint64(l))}
			}
			total += int(l)
		}
		if flat == nil && total > 0 {
			return null("flat")
		}
		var mem []byte
		if total > 0 {
			mem = unsafe.Slice((*byte)(unsafe.Pointer(flat)), total)
		}
		all := make([][]byte, n)
		off := 0
		for i, l := range ls {
			all[i] = append([]byte(nil), mem[off:off+int(l)]...)
			off += int(l)
		}
		return t.Deliver(all)
	})
}

//export kvxfer_go_group_fail
func kvxfer_go_group_fail(h C.uint64_t, why *C.char) C.int {
	return guard(func() error {
		t, err := transceivers.Get(uint64(h))
		if err != nil {
			return err
		}
		msg := "round failed"
		if why != nil {
			msg = C.GoString(why)
		}
		return t.Fail(msg)
	})
}
