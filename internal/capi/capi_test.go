package capi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
)

const tcpYAML = "cache_transceiver_config:\n  backend: TCP\n  kv_transfer_timeout_ms: 5000\n"

func noEnv() config.Env { return config.LoadEnv(func(string) (string, bool) { return "", false }, nil) }

// smallBuffers is the tests' environment: a 1 MiB transfer buffer. TRT-LLM's
// default, 512 MiB, is allocated at a rank's first staged send; under -race,
// clearing a freed one again for the next test's buffer took seconds, in
// which the whole test process stalled and requests timed out.
func smallBuffers() config.Env {
	return config.EnvFromMap(map[string]string{config.EnvTransferBuffer: "1MiB"})
}

func loadTCP(t *testing.T) *Config {
	t.Helper()
	c, err := LoadConfig("test.yaml", []byte(tcpYAML), smallBuffers())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestLoadConfigMessages: a bad config gives config check's own messages
// (file:line:col) and CodeConfig; text and path load the same config.
func TestLoadConfigMessages(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "w.yaml")
	if err := os.WriteFile(path, []byte(tcpYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	fromFile, err := LoadConfig(path, nil, noEnv())
	if err != nil {
		t.Fatal(err)
	}
	if got, want := fromFile.Backend(), loadTCP(t).Backend(); got != want || got != "TCP → TCP" {
		t.Errorf("backend from file %q, from text %q, want both TCP → TCP", got, want)
	}
	for _, tc := range []struct {
		name, yaml string
		want       string // regexp the message must match
	}{
		{"unknown backend", "cache_transceiver_config:\n  backend: PIGEON\n", `^bad\.yaml:2:\d+: .*PIGEON`},
		{"bad timeout", "cache_transceiver_config:\n  backend: TCP\n  kv_transfer_timeout_ms: -3\n", `^bad\.yaml:3:\d+: `},
		{"not yaml", "cache_transceiver_config: [\n", `^bad\.yaml:`},
		{"no transceiver", "tensor_parallel_size: 1\n", `no cache_transceiver_config\.backend`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want, cerr := config.LoadBytes("bad.yaml", []byte(tc.yaml), noEnv())
			_, err := LoadConfig("bad.yaml", []byte(tc.yaml), noEnv())
			if err == nil {
				t.Fatal("loaded")
			}
			if CodeOf(err) != CodeConfig {
				t.Errorf("code %v, want %v", CodeOf(err), CodeConfig)
			}
			if !regexp.MustCompile(tc.want).MatchString(err.Error()) {
				t.Errorf("message %q does not match %q", err, tc.want)
			}
			if cerr != nil && want != nil && err.Error() != cerr.Error() {
				t.Errorf("message %q, config check's %q", err, cerr)
			}
		})
	}
	cluster := "../../config/testdata/good/disagg_trtllm.yaml"
	if _, err := LoadConfig(cluster, nil, noEnv()); CodeOf(err) != CodeConfig || !strings.Contains(err.Error(), "is a cluster file") {
		t.Errorf("cluster file: %v (%v)", err, CodeOf(err))
	}
	if _, err := LoadConfig(filepath.Join(dir, "missing.yaml"), nil, noEnv()); CodeOf(err) != CodeConfig || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("missing file: %v (%v)", err, CodeOf(err))
	}
}

func TestCodeOf(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want Code
	}{
		{nil, OK},
		{ErrBadHandle, CodeBadHandle},
		{ErrNotFound, CodeNotFound},
		{ErrInFlight, CodeInFlight},
		{errors.Join(transceiver.ErrTimeout), CodeTimeout},
		{context.DeadlineExceeded, CodeTimeout},
		{transceiver.ErrCanceled, CodeCanceled},
		{transceiver.ErrPeerLost, CodePeer},
		{transceiver.ErrRefused, CodePeer},
		{transceiver.ErrClosed, CodeClosed},
		{transceiver.ErrForgedOpaqueState, CodeBadOpaqueState},
		{&layout.IncompatibleError{}, CodeIncompatible},
		{errors.New("something else"), CodeTransfer},
		{&Error{Code: CodeUnsupported, Err: errors.New("x")}, CodeUnsupported},
		{fmt.Errorf("x: %w", transceiver.ErrGroupLost), CodeGroup},
		{transceiver.ErrNotJoined, CodeGroup},
		{fmt.Errorf("x: %w", transceiver.ErrStalled), CodePeer},
		{fmt.Errorf("x: %w", transceiver.ErrInvalidRequest), CodeInvalidArgument},
		{kvcache.ErrBadBlock, CodeInvalidArgument},
	} {
		if got := CodeOf(tc.err); got != tc.want {
			t.Errorf("CodeOf(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// TestCodesMatchHeader holds the Code values and names in step with the
// enum of include/kvxfer.h.
func TestCodesMatchHeader(t *testing.T) {
	h, err := os.ReadFile("../../include/kvxfer.h")
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`(?m)^\s*(KVXFER_(?:OK|ERR_[A-Z_]+))\s*=\s*(\d+),`)
	got := map[string]int{}
	for _, m := range re.FindAllSubmatch(h, -1) {
		v, _ := strconv.Atoi(string(m[2]))
		got[string(m[1])] = v
	}
	if len(got) != len(Codes()) {
		t.Errorf("the header has %d codes, Go %d", len(got), len(Codes()))
	}
	for _, c := range Codes() {
		if v, ok := got[c.String()]; !ok || v != int(c) {
			t.Errorf("%s = %d in Go, %d (present %v) in the header", c, int32(c), v, ok)
		}
	}
}

func TestTable(t *testing.T) {
	tb := NewTable[string]("thing")
	a, b := tb.Put("a"), tb.Put("b")
	if a == 0 || b == 0 || a == b {
		t.Fatalf("handles %d %d", a, b)
	}
	if v, err := tb.Get(b); err != nil || v != "b" {
		t.Errorf("Get(b) = %q, %v", v, err)
	}
	if _, ok := tb.Delete(a); !ok {
		t.Error("Delete(a) found nothing")
	}
	if _, ok := tb.Delete(a); ok {
		t.Error("second Delete(a) found it")
	}
	if _, err := tb.Get(a); !errors.Is(err, ErrBadHandle) || !strings.Contains(err.Error(), "thing handle") {
		t.Errorf("Get of a deleted handle: %v", err)
	}
	if _, err := tb.Get(0); !errors.Is(err, ErrBadHandle) {
		t.Errorf("Get(0): %v", err)
	}
	if c := tb.Put("c"); c == a || c == b {
		t.Errorf("handle %d reused", c)
	}
}

// TestTableKinds: a handle of one kind is not a handle of another (the
// header's KVXFER_ERR_BAD_HANDLE), so a config handle given where a
// transceiver's is due cannot reach, or close, a transceiver.
func TestTableKinds(t *testing.T) {
	configs, transceivers := NewTable[string]("config"), NewTable[string]("transceiver")
	c, tr := configs.Put("c"), transceivers.Put("t")
	if _, err := transceivers.Get(c); !errors.Is(err, ErrBadHandle) || !strings.Contains(err.Error(), "transceiver handle") {
		t.Errorf("a config handle given as a transceiver's: %v", err)
	}
	if _, ok := transceivers.Delete(c); ok {
		t.Error("deleting a config handle from the transceivers deleted a transceiver")
	}
	if _, err := configs.Get(tr); !errors.Is(err, ErrBadHandle) {
		t.Errorf("a transceiver handle given as a config's: %v", err)
	}
	if v, err := transceivers.Get(tr); err != nil || v != "t" {
		t.Errorf("Get(%d) = %q, %v", tr, v, err)
	}
}

// desc is a small model: 4 layers, 4 KV heads of 16 fp16 values, 8 tokens
// per block.
func desc(tp int) StateDesc {
	return StateDesc{Layers: 4, KVHeads: 4, HeadDim: 16, TokensPerBlock: 8, DType: kvcache.FP16, TP: tp, PP: 1}
}

func open(t *testing.T, d StateDesc, mem [][]byte, blocks int) *Transceiver {
	t.Helper()
	st, err := d.CacheState()
	if err != nil {
		t.Fatal(err)
	}
	o := Options{State: d}
	for i := range st.Parallel.NumRanks() {
		var m []byte
		if mem != nil {
			m = mem[i]
		}
		o.Pools = append(o.Pools, PoolSpec{Memory: m, NumBlocks: blocks, BlockBytes: st.RankLayout(i).BlockBytes()})
	}
	tr, err := Open(context.Background(), loadTCP(t), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

// fill writes the reference sharding of a seeded logical cache of tokens
// tokens into blocks of each rank's memory, and returns it per rank.
func fill(t *testing.T, tr *Transceiver, tokens int, seed uint64, blocks []kvcache.BlockID) [][][]byte {
	t.Helper()
	st := tr.State()
	l, err := layout.NewLogical(st.Shape, tokens)
	if err != nil {
		t.Fatal(err)
	}
	l.Fill(seed)
	var out [][][]byte
	for i, r := range tr.Ranks() {
		want, err := layout.Shard(l, st, r)
		if err != nil {
			t.Fatal(err)
		}
		bb := st.RankLayout(r).BlockBytes()
		mem := tr.PoolMemory(i)
		for k, b := range blocks {
			copy(mem[int64(b)*bb:], want[k])
		}
		out = append(out, want)
	}
	return out
}

func perRank(n int, ids []kvcache.BlockID) [][]kvcache.BlockID {
	out := make([][]kvcache.BlockID, n)
	for i := range out {
		out[i] = ids
	}
	return out
}

// TestTransferCallerAndSharedMemory moves a cache from a context instance
// on kvxfer's shareable pools to a generation instance on the caller's
// memory, TP2 → TP1 (every rank in this process), bit-exact against the
// reference sharding, and checks the status calls' at-least semantics and
// queues.
func TestTransferCallerAndSharedMemory(t *testing.T) {
	prefill := open(t, desc(2), nil, 16)
	st1, _ := desc(1).CacheState()
	callerMem := make([]byte, 16*st1.RankLayout(0).BlockBytes())
	gen := open(t, desc(1), [][]byte{callerMem}, 16)

	const tokens = 20 // 3 blocks
	ctxBlocks := []kvcache.BlockID{5, 2, 9}
	fill(t, prefill, tokens, 7, ctxBlocks)
	opaque, err := prefill.RespondAndSend(11, 0, tokens, perRank(2, ctxBlocks))
	if err != nil {
		t.Fatal(err)
	}
	if again, err := prefill.OpaqueState(11); err != nil || !bytes.Equal(again, opaque) {
		t.Errorf("OpaqueState(11) = %d bytes, %v", len(again), err)
	}
	if _, err := prefill.RespondAndSend(11, 0, tokens, perRank(2, ctxBlocks)); CodeOf(err) != CodeInFlight {
		t.Errorf("a second respond of id 11: %v (%v)", err, CodeOf(err))
	}
	if got, err := prefill.CheckContextStatus(context.Background(), 0, 8); err != nil || len(got) != 0 {
		t.Errorf("context status before any pull: %v, %v", got, err)
	}
	genBlocks := []kvcache.BlockID{0, 15, 3}
	if err := gen.RequestAndReceive(21, 0, tokens, opaque, [][]kvcache.BlockID{genBlocks}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := gen.CheckGenStatus(ctx, 1, 8)
	if err != nil || len(got) != 1 || got[0].ID != 21 || got[0].Code != OK {
		t.Fatalf("gen status: %+v, %v", got, err)
	}
	if !gen.GenTransferComplete() {
		t.Error("GenTransferComplete false after the only receive ended")
	}
	l, _ := layout.NewLogical(st1.Shape, tokens)
	l.Fill(7)
	want, _ := layout.Shard(l, st1, 0)
	bb := st1.RankLayout(0).BlockBytes()
	for k, b := range genBlocks {
		if !bytes.Equal(callerMem[int64(b)*bb:int64(b+1)*bb], want[k]) {
			t.Errorf("block %d (generation block %d) differs from the reference", k, b)
		}
	}
	got, err = prefill.CheckContextStatus(ctx, -1, 8)
	if err != nil || len(got) != 1 || got[0].ID != 11 || got[0].Code != OK {
		t.Fatalf("context status: %+v, %v", got, err)
	}
	if _, err := prefill.OpaqueState(11); CodeOf(err) != CodeNotFound {
		t.Errorf("OpaqueState after report: %v", err)
	}
}

// TestStatusRoomAndCancel: cancelled requests are reported failed with
// CodeCanceled and their message; a status call with room for fewer ids
// keeps the rest for the next call; a wait that times out says so.
func TestStatusRoomAndCancel(t *testing.T) {
	prefill := open(t, desc(1), nil, 8)
	for id := uint64(1); id <= 3; id++ {
		if _, err := prefill.RespondAndSend(id, 0, 8, [][]kvcache.BlockID{{kvcache.BlockID(id)}}); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	got, err := prefill.CheckContextStatus(ctx, 1, 8)
	if CodeOf(err) != CodeTimeout || len(got) != 0 {
		t.Errorf("wait with nothing ending: %v, %v (%v)", got, err, CodeOf(err))
	}
	for id := uint64(1); id <= 3; id++ {
		if !prefill.Cancel(id) {
			t.Errorf("Cancel(%d) = false", id)
		}
	}
	if prefill.Cancel(99) {
		t.Error("Cancel of an unknown id = true")
	}
	var all []Finished
	for range 3 {
		got, err := prefill.CheckContextStatus(context.Background(), 3-len(all), 1)
		if err != nil || len(got) != 1 {
			t.Fatalf("status with room for 1: %+v, %v", got, err)
		}
		all = append(all, got...)
	}
	for _, f := range all {
		if f.Code != CodeCanceled {
			t.Errorf("request %d: %v, want canceled", f.ID, f.Code)
		}
		if err := prefill.RequestError(false, f.ID); !errors.Is(err, transceiver.ErrCanceled) || !strings.HasPrefix(err.Error(), fmt.Sprintf("capi: context request %d: ", f.ID)) {
			t.Errorf("RequestError(%d) = %v", f.ID, err)
		}
	}
	if err := prefill.RequestError(true, 1); CodeOf(err) != CodeNotFound {
		t.Errorf("RequestError of the other side: %v", err)
	}
}

// TestBadArguments: what the caller can get wrong is refused with the code
// and a message that names it.
func TestBadArguments(t *testing.T) {
	c := loadTCP(t)
	tr := open(t, desc(1), nil, 4)
	st, _ := desc(1).CacheState()
	bb := st.RankLayout(0).BlockBytes()
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		err  error
		code Code
		msg  string
	}{
		{"block out of range", func() error {
			_, err := tr.RespondAndSend(1, 0, 8, [][]kvcache.BlockID{{4}})
			return err
		}(), CodeInvalidArgument, "block 4 of rank 0 is out of range [0,4)"},
		{"blocks for two ranks", tr.RequestAndReceive(1, 0, 0, []byte{1}, [][]kvcache.BlockID{{0}, {1}}), CodeInvalidArgument, "block ids for 2 ranks"},
		{"garbage opaque", tr.RequestAndReceive(2, 0, 0, []byte("not a state"), [][]kvcache.BlockID{{0}}), CodeBadOpaqueState, "opaque"},
		{"empty opaque", tr.RequestAndReceive(3, 0, 0, nil, [][]kvcache.BlockID{{0}}), CodeBadOpaqueState, "empty opaque state"},
		{"bad shape", func() error {
			d := desc(1)
			d.KVHeads = 0
			_, err := Open(ctx, c, Options{State: d, Pools: []PoolSpec{{NumBlocks: 1}}})
			return err
		}(), CodeInvalidArgument, "cache state"},
		{"block bytes differ", func() error {
			_, err := Open(ctx, c, Options{State: desc(1), Pools: []PoolSpec{{NumBlocks: 2, BlockBytes: bb + 1}}})
			return err
		}(), CodeInvalidArgument, "block_bytes"},
		{"memory too small", func() error {
			_, err := Open(ctx, c, Options{State: desc(1), Pools: []PoolSpec{{Memory: make([]byte, bb), NumBlocks: 2}}})
			return err
		}(), CodeInvalidArgument, "needed"},
		{"ranks in other processes", func() error {
			_, err := Open(ctx, c, Options{State: desc(2), Ranks: []int{1}, Pools: []PoolSpec{{NumBlocks: 2}}})
			return err
		}(), CodeInvalidArgument, "a group (coordinated or gather) is needed"},
		{"group for a whole instance", func() error {
			_, err := Open(ctx, c, Options{State: desc(1), Pools: []PoolSpec{{NumBlocks: 2}}, Group: GroupSpec{Mode: GroupGather, Processes: 1}})
			return err
		}(), CodeInvalidArgument, "no group is needed"},
		{"ranks repeated", func() error {
			_, err := Open(ctx, c, Options{State: desc(2), Ranks: []int{1, 1}, Pools: []PoolSpec{{NumBlocks: 2}, {NumBlocks: 2}}})
			return err
		}(), CodeInvalidArgument, "ranks [1 1]: not ascending without repeats"},
		{"ranks descending", func() error {
			_, err := Open(ctx, c, Options{State: desc(2), Ranks: []int{1, 0}, Pools: []PoolSpec{{NumBlocks: 2}, {NumBlocks: 2}}})
			return err
		}(), CodeInvalidArgument, "ranks [1 0]: not ascending without repeats"},
		{"gather without a group", func() error {
			_, err := tr.Outbox()
			return err
		}(), CodeInvalidArgument, "no gather group"},
	} {
		if tc.err == nil {
			t.Errorf("%s: accepted", tc.name)
			continue
		}
		if CodeOf(tc.err) != tc.code || !strings.Contains(tc.err.Error(), tc.msg) {
			t.Errorf("%s: %v (%v), want %v and %q", tc.name, tc.err, CodeOf(tc.err), tc.code, tc.msg)
		}
	}
}

// TestSyncTimeoutAndClose: a sync receive from a context instance that
// never answers ends in CodeTimeout at its deadline and cancels the pull;
// after Close every call says closed, and Close is idempotent.
func TestSyncTimeoutAndClose(t *testing.T) {
	prefill := open(t, desc(1), nil, 4)
	gen := open(t, desc(1), nil, 4)
	opaque, err := prefill.RespondAndSend(1, 0, 8, [][]kvcache.BlockID{{0}})
	if err != nil {
		t.Fatal(err)
	}
	prefill.Close() // the context side is gone
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	err = gen.RequestAndReceiveSync(ctx, 5, 0, 8, opaque, [][]kvcache.BlockID{{1}})
	if c := CodeOf(err); c != CodePeer && c != CodeTimeout {
		t.Errorf("receive from a closed context instance: %v (%v)", err, c)
	}
	if got, _ := gen.CheckGenStatus(context.Background(), 0, 8); len(got) != 0 {
		t.Errorf("a sync receive was reported by a status call: %+v", got)
	}
	gen.Close()
	if err := gen.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := gen.RequestAndReceive(6, 0, 8, opaque, [][]kvcache.BlockID{{1}}); CodeOf(err) != CodeClosed {
		t.Errorf("receive after Close: %v (%v)", err, CodeOf(err))
	}
}

// TestConcurrentCalls: respond, receive, status and cancel from many
// goroutines at once on the same handles (the C ABI's threads), under
// -race; every request is reported exactly once, on each side.
func TestConcurrentCalls(t *testing.T) {
	prefill := open(t, desc(1), nil, 64)
	gen := open(t, desc(1), nil, 64)
	const workers, each = 8, 6
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for k := range each {
				id := uint64(w*each + k + 1)
				b := kvcache.BlockID(id % 64)
				op, err := prefill.RespondAndSend(id, 0, 8, [][]kvcache.BlockID{{b}})
				if err != nil {
					t.Error(err)
					return
				}
				if k == each-1 {
					prefill.Cancel(id) // some are cancelled before the pull
				}
				if err := gen.RequestAndReceive(id+1000, 0, 8, op, [][]kvcache.BlockID{{b}}); err != nil {
					t.Error(err)
				}
			}
		})
	}
	seen := map[uint64]int{}
	var mu sync.Mutex
	collect := func(tr *Transceiver, gen bool) {
		for range workers {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				for {
					check := tr.CheckContextStatus
					if gen {
						check = tr.CheckGenStatus
					}
					got, err := check(ctx, 1, 3)
					mu.Lock()
					for _, f := range got {
						seen[f.ID]++
					}
					n := len(seen)
					mu.Unlock()
					if n == 2*workers*each || err != nil {
						return
					}
					if len(got) == 0 {
						time.Sleep(time.Millisecond)
					}
				}
			})
		}
	}
	collect(prefill, false)
	collect(gen, true)
	wg.Wait()
	if len(seen) != 2*workers*each {
		t.Errorf("%d requests reported, want %d", len(seen), 2*workers*each)
	}
	for id, n := range seen {
		if n != 1 {
			t.Errorf("request %d reported %d times", id, n)
		}
	}
}

// TestBadRequestArguments: a request's own arguments that do not fit the
// instance (a DP rank without attention DP, a negative prompt length, a
// hosted rank of the request without blocks) are KVXFER_ERR_INVALID_ARGUMENT
// naming them, and so is a block listed twice (a receive would write two
// of the context's blocks into one), checked before the transceiver: a
// receive's opaque state is then not spent (with a cluster secret its nonce is recorded once) and
// the corrected call pulls it.
func TestBadRequestArguments(t *testing.T) {
	env := config.EnvFromMap(map[string]string{config.EnvTransferBuffer: "1MiB", config.EnvClusterSecret: strings.Repeat("5a", 32)})
	c, err := LoadConfig("secret.yaml", []byte(tcpYAML), env)
	if err != nil {
		t.Fatal(err)
	}
	openSigned := func() *Transceiver {
		tr, err := Open(context.Background(), c, Options{State: desc(1), Pools: []PoolSpec{{NumBlocks: 4}}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close() })
		return tr
	}
	prefill, gen := openSigned(), openSigned()
	for _, tc := range []struct {
		name string
		err  error
		msg  string
	}{
		{"negative prompt", func() error { _, err := prefill.RespondAndSend(2, 0, -1, [][]kvcache.BlockID{{0}}); return err }(), "num_tokens -1"},
		{"dp rank without attention DP", func() error { _, err := prefill.RespondAndSend(3, 1, 8, [][]kvcache.BlockID{{0}}); return err }(), "dp_rank 1"},
		{"no blocks", func() error { _, err := prefill.RespondAndSend(4, 0, 8, [][]kvcache.BlockID{{}}); return err }(), "no blocks"},
	} {
		if CodeOf(tc.err) != CodeInvalidArgument || !strings.Contains(tc.err.Error(), tc.msg) {
			t.Errorf("%s: %v (%v), want %v and %q", tc.name, tc.err, CodeOf(tc.err), CodeInvalidArgument, tc.msg)
		}
	}
	opaque, err := prefill.RespondAndSend(1, 0, 8, [][]kvcache.BlockID{{0}})
	if err != nil {
		t.Fatal(err)
	}
	for _, dp := range []int{-1, 1} {
		err := gen.RequestAndReceive(5, dp, 8, opaque, [][]kvcache.BlockID{{1}})
		if CodeOf(err) != CodeInvalidArgument || !strings.Contains(err.Error(), fmt.Sprintf("dp_rank %d", dp)) {
			t.Errorf("receive with dp_rank %d: %v (%v), want %v", dp, err, CodeOf(err), CodeInvalidArgument)
		}
	}
	if err := gen.RequestAndReceive(5, 0, -8, opaque, [][]kvcache.BlockID{{1}}); CodeOf(err) != CodeInvalidArgument {
		t.Errorf("receive with num_tokens -8: %v (%v), want %v", err, CodeOf(err), CodeInvalidArgument)
	}
	if err := gen.RequestAndReceive(5, 0, 8, opaque, [][]kvcache.BlockID{{1, 1}}); CodeOf(err) != CodeInvalidArgument || !strings.Contains(err.Error(), "block 1 of rank 0 is listed twice") {
		t.Errorf("receive into one block twice: %v (%v), want %v", err, CodeOf(err), CodeInvalidArgument)
	}
	if _, err := prefill.RespondAndSend(6, 0, 16, [][]kvcache.BlockID{{2, 2}}); CodeOf(err) != CodeInvalidArgument || !strings.Contains(err.Error(), "block 2 of rank 0 is listed twice") {
		t.Errorf("respond of one block twice: %v (%v), want %v", err, CodeOf(err), CodeInvalidArgument)
	}
	if err := gen.RequestAndReceive(5, 0, 8, opaque, [][]kvcache.BlockID{{1}}); err != nil {
		t.Fatalf("the corrected receive: %v (%v)", err, CodeOf(err))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	got, err := gen.CheckGenStatus(ctx, 1, 8)
	if err != nil || len(got) != 1 || got[0].Code != OK {
		t.Errorf("the corrected receive ended: %+v, %v", got, err)
	}
}
