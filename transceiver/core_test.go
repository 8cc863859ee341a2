package transceiver

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// The interpreters of the core scripts (testdata/send, testdata/recv,
// testdata/consensus; see script_test.go for the format). Times in the
// scripts are offsets from scriptT0; layouts are given by their parallel
// sizes over a small shape (4 layers, 4 KV heads of 16, 4 tokens a block,
// bf16: 4 KiB a block on one rank), which arguments may change.

func TestSendCoreScripts(t *testing.T) {
	runScripts(t, "testdata/send/*.script", func() func(*testing.T, *scriptCmd) string { return (&sendInterp{}).run })
}

func TestRecvCoreScripts(t *testing.T) {
	runScripts(t, "testdata/recv/*.script", func() func(*testing.T, *scriptCmd) string { return (&recvInterp{}).run })
}

func TestConsensusScripts(t *testing.T) {
	runScripts(t, "testdata/consensus/*.script", func() func(*testing.T, *scriptCmd) string {
		return (&consensusInterp{c: newConsensus()}).run
	})
}

var scriptT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

const (
	scriptSendID = 7 // the context request of the scripts
	scriptRecvID = 9 // the receiving rank's id of it
	scriptReqID  = 5 // the generation request
)

var scriptToken = [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}

// scriptHash is the reuse hash of block i of the scripts' context request
// (named h<i>); hx is a hash no block has.
func scriptHash(t *testing.T, name string) kvcache.Hash {
	if name == "hx" {
		return kvcache.Hash{0xff}
	}
	var i int
	if _, err := fmt.Sscanf(name, "h%d", &i); err != nil {
		t.Fatalf("hash %q: want h<block> or hx", name)
	}
	return kvcache.Hash{byte(i + 1)}
}

func scriptErr(c *scriptCmd, key string) error {
	switch v := c.str(key, ""); v {
	case "":
		return nil
	case "canceled":
		return ErrCanceled
	case "closed":
		return ErrClosed
	case "peer-lost": // a data connection's loss, as a transport reports it
		return fmt.Errorf("tcp: send: %w: connection reset by peer", transport.ErrPeerLost)
	default:
		return errors.New(v)
	}
}

func scriptAt(t *testing.T, c *scriptCmd) time.Time { return scriptT0.Add(c.dur(t, "at", 0)) }

// scriptState is a CacheState of the scripts: base's shape with the
// command's changes (layers, heads, head-dim, dtype=fp16, mla) and parallel
// sizes prefix+tp and prefix+pp (default 1).
func scriptState(t *testing.T, c *scriptCmd, base layout.CacheState, prefix string) layout.CacheState {
	sh := base.Shape
	dt := sh.DType
	if c.str("dtype", "") == "fp16" {
		dt = kvcache.FP16
	}
	mla := base.Attention == layout.AttentionMLA || c.flag("mla")
	heads := c.int(t, "heads", sh.KVHeads)
	return state(c.int(t, "layers", sh.Layers), heads, c.int(t, "head-dim", sh.HeadDim), sh.TokensPerBlock, dt,
		c.int(t, prefix+"tp", 1), c.int(t, prefix+"pp", 1), mla)
}

var scriptShape = state(4, 4, 16, 4, kvcache.BF16, 1, 1, false)

// describe is an effect as the scripts show it.
func describe(e fmt.Stringer) string {
	if a, ok := e.(effArmTimer); ok {
		return "arm-timer at=+" + a.at.Sub(scriptT0).String()
	}
	return e.String()
}

// sendInterp runs a send core.
type sendInterp struct {
	core *sendCore
	base layout.CacheState
	addr map[int]route // generation rank → where its accepted ask came from
	// before is addr before the ask being run.
	before map[int]route
}

func (in *sendInterp) run(t *testing.T, c *scriptCmd) string {
	if c.name != "new-sender" && in.core == nil {
		t.Fatalf("%s: new-sender first", c.pos)
	}
	gen := c.int(t, "gen", 0)
	switch c.name {
	case "new-sender":
		// new-sender [rank=] [tp=] [pp=] [shape] [blocks=4] [hashes=n]
		// [backends=tcp] [buf=65536] [timeout=10s] [sender-timeout=0]
		in.base = scriptState(t, c, scriptShape, "")
		var hashes []kvcache.Hash
		for i := range c.int(t, "hashes", 0) {
			hashes = append(hashes, scriptHash(t, fmt.Sprintf("h%d", i)))
		}
		in.core = newSendCore(sendConfig{rank: c.int(t, "rank", 0), id: scriptSendID, token: scriptToken, state: in.base,
			blocks: c.int(t, "blocks", 4), hashes: hashes, backends: strings.Split(c.str("backends", "tcp"), ","),
			bufBytes: int64(c.int(t, "buf", 64<<10)), timeout: c.dur(t, "timeout", 10*time.Second),
			senderTimeout: c.dur(t, "sender-timeout", 0)})
		in.addr = map[int]route{}
		return ""
	case "start":
		return in.step(t, route{}, evStart{now: scriptAt(t, c)})
	case "ask":
		// ask gen= [tp=] [pp=] [shape] [blocks=] [last=h<i>] [backend=tcp]
		// [max-chunk=64] [direct] [wrong-token] [garbage-state]
		// [id=7] [conn=gen+1] [req=100] [at=0s]
		// req is the pull (attempt) the ask belongs to, one for every
		// generation rank of it.
		from := route{conn: connID(c.int(t, "conn", gen+1)), sendID: uint64(c.int(t, "id", scriptSendID)), recvID: uint64(c.int(t, "req", 100))}
		st, _ := scriptState(t, c, in.base, "").MarshalBinary()
		if c.flag("garbage-state") {
			st = []byte{0xde, 0xad}
		}
		ri := &wire.RequestInfo{CtxRequestID: from.sendID, Token: scriptToken, GenRequestID: from.recvID, GenRank: uint32(gen), GenState: st,
			NumBlocks: uint32(c.int(t, "blocks", in.core.cfg.blocks)), Backend: c.str("backend", "tcp"), MaxChunkBlocks: uint32(c.int(t, "max-chunk", 64))}
		if c.flag("wrong-token") {
			ri.Token[0] ^= 1
		}
		if l := c.str("last", ""); l != "" {
			ri.HasLastHash, ri.LastHash = true, scriptHash(t, l)
		}
		if c.flag("direct") {
			ri.Desc = []byte("receipt")
		}
		if from.sendID != scriptSendID {
			// The driver's answer for a request the rank does not hold.
			return in.print(from, []effect{refuseUnknown(in.core.cfg.rank, from, ri, "")})
		}
		return in.step(t, from, evAsk{from: from, ri: ri, now: scriptAt(t, c)})
	case "desc":
		return in.step(t, route{}, evChunkDesc{from: in.from(t, c, gen), index: c.int(t, "index", 0), desc: []byte("chunk receipt")})
	case "overflow":
		return in.step(t, route{}, evDescOverflow{gen: gen, attempt: uint64(c.int(t, "attempt", int(in.core.attempt)))})
	case "sent":
		// sent gen= [attempt=the current one] [err=]
		return in.step(t, route{}, evSent{gen: gen, attempt: uint64(c.int(t, "attempt", int(in.core.attempt))), err: scriptErr(c, "err")})
	case "attempt-failed":
		// The instance's word: attempt-failed attempt= [err=] [at=]
		return in.step(t, route{}, evAttemptFailed{attempt: uint64(c.int(t, "attempt", 0)), err: orDefault(scriptErr(c, "err"), errors.New("failed on another rank")), now: scriptAt(t, c)})
	case "commit":
		return in.step(t, route{}, evCommit{attempt: uint64(c.int(t, "attempt", 0))})
	case "abort":
		return in.step(t, route{}, evGenAbort{from: in.from(t, c, gen), reason: c.str("reason", "")})
	case "conn-lost":
		return in.step(t, route{}, evConnLost{conn: connID(c.int(t, "conn", 1)), err: errors.New(c.str("err", "peer lost"))})
	case "tick":
		return in.step(t, route{}, evTick{now: scriptAt(t, c)})
	case "cancel":
		return in.step(t, route{}, evCancel{err: orDefault(scriptErr(c, "err"), ErrCanceled)})
	case "phase":
		return "phase " + in.core.state().String()
	}
	t.Fatalf("%s: unknown command %s", c.pos, c.name)
	return ""
}

// from is where a frame of gen comes from: its accepted ask's route unless
// the command says otherwise.
func (in *sendInterp) from(t *testing.T, c *scriptCmd, gen int) route {
	r := in.addr[gen]
	if c.has("conn") {
		r.conn = connID(c.int(t, "conn", 0))
	}
	if c.has("req") {
		r.recvID = uint64(c.int(t, "req", 0))
	}
	return r
}

// step runs ev (from: the route of an ask, else zero) and prints its
// effects.
func (in *sendInterp) step(t *testing.T, from route, ev event) string {
	in.before = maps.Clone(in.addr)
	effs := in.core.step(ev)
	for g, p := range in.core.peers {
		in.addr[g] = p.to
	}
	out := in.print(from, effs)
	in.before = nil
	return out
}

// print shows the effects, checking where each is addressed: a refusal to
// the asker, the rest to the generation rank's accepted ask.
func (in *sendInterp) print(from route, effs []effect) string {
	var lines []string
	for _, e := range effs {
		line := describe(e)
		var to, want route
		switch e := e.(type) {
		case effRefuse:
			to, want = e.to, from
			if from == (route{}) {
				want = to // (the refusal of an ask that waited)
			}
		case effReady:
			to, want = e.to, in.addr[e.gen]
		case effStartSend:
			to, want = e.to, in.addr[e.gen]
		case effAbort:
			to, want = e.to, in.addr[e.peer]
			if old, ok := in.before[e.peer]; ok && to == old {
				want = old // (an abort of the attempt an ask superseded)
			}
			if from != (route{}) && to == from {
				want = from // (the answer to an ask of a failed attempt)
			}
		}
		if to != want {
			line += fmt.Sprintf(" !! addressed to %+v, want %+v", to, want)
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

func orDefault(err, def error) error {
	if err == nil {
		return def
	}
	return err
}

// recvInterp runs a receive core.
type recvInterp struct {
	core *recvCore
	conn map[int]connID // source → connection it was dialled on
}

func (in *recvInterp) run(t *testing.T, c *scriptCmd) string {
	if c.name != "new-receiver" && in.core == nil {
		t.Fatalf("%s: new-receiver first", c.pos)
	}
	src := c.int(t, "src", 0)
	switch c.name {
	case "new-receiver":
		// new-receiver [rank=] [tp=] [pp=] [src-tp=] [src-pp=] [shape]
		// [blocks=4] [last=h<i>] [buf=65536] [no-direct] [endpoints=]
		// [timeout=10s]
		sender := scriptState(t, c, scriptShape, "src-")
		cfg := recvConfig{rank: c.int(t, "rank", 0), id: scriptRecvID, reqID: scriptReqID, sendID: scriptSendID, token: scriptToken,
			sender: sender, self: scriptState(t, c, scriptShape, ""), peers: c.int(t, "endpoints", sender.Parallel.NumRanks()),
			blocks: c.int(t, "blocks", 4), bufBytes: int64(c.int(t, "buf", 64<<10)), direct: !c.flag("no-direct"),
			timeout: c.dur(t, "timeout", 10*time.Second)}
		if l := c.str("last", ""); l != "" {
			h := scriptHash(t, l)
			cfg.lastHash = &h
		}
		in.conn = map[int]connID{}
		core, err := newRecvCore(cfg)
		if err != nil {
			in.core = nil
			return "error: " + err.Error()
		}
		in.core = core
		return ""
	case "start":
		return in.step(evStart{now: scriptAt(t, c)})
	case "dialled":
		in.conn[src] = connID(c.int(t, "conn", src+1))
		return in.step(evDialled{src: src, conn: in.conn[src], backend: c.str("backend", "tcp")})
	case "ask-failed":
		return in.step(evAskFailed{src: src, err: scriptErr(c, "err")})
	case "ready":
		return in.step(evReady{conn: in.frameConn(t, c, src), src: src, chunk: c.int(t, "chunk", 4)})
	case "refused":
		return in.step(evRefused{conn: in.frameConn(t, c, src), src: src, reason: c.str("reason", "")})
	case "abort":
		return in.step(evSrcAbort{conn: in.frameConn(t, c, src), src: src, reason: c.str("reason", "")})
	case "received":
		return in.step(evReceived{src: src, err: scriptErr(c, "err")})
	case "conn-lost":
		return in.step(evConnLost{conn: connID(c.int(t, "conn", 1)), err: errors.New(c.str("err", "peer lost"))})
	case "tick":
		return in.step(evTick{now: scriptAt(t, c)})
	case "cancel":
		return in.step(evCancel{err: orDefault(scriptErr(c, "err"), ErrCanceled)})
	case "phase":
		return "phase " + in.core.state().String()
	}
	t.Fatalf("%s: unknown command %s", c.pos, c.name)
	return ""
}

// frameConn is the connection a frame from src arrives on: the one it was
// dialled on unless the command says otherwise.
func (in *recvInterp) frameConn(t *testing.T, c *scriptCmd, src int) connID {
	if c.has("conn") {
		return connID(c.int(t, "conn", 0))
	}
	return in.conn[src]
}

// step shows the effects of ev, checking where each is addressed: to the
// source's connection (none before it was dialled), with the request's ids.
func (in *recvInterp) step(ev event) string {
	var lines []string
	for _, e := range in.core.step(ev) {
		line := describe(e)
		var to route
		src := -1
		switch e := e.(type) {
		case effRequestInfo:
			to, src = e.to, e.src
		case effStartRecv:
			to, src = e.to, e.src
		case effAbort:
			to, src = e.to, e.peer
		}
		if want := (route{conn: in.conn[src], sendID: scriptSendID, recvID: scriptRecvID}); src >= 0 && to != want {
			line += fmt.Sprintf(" !! addressed to %+v, want %+v", to, want)
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

// consensusInterp runs the instance consensus.
type consensusInterp struct{ c *consensus }

// scriptKey is the request a consensus command names: send|recv id=.
func scriptKey(t *testing.T, c *scriptCmd) instKey {
	if len(c.words) == 0 || (c.words[0] != "send" && c.words[0] != "recv") {
		t.Fatalf("%s: %s send|recv ...", c.pos, c.name)
	}
	c.flag(c.words[0])
	key := instKey{sideSend, uint64(c.int(t, "id", 1))}
	if c.words[0] == "recv" {
		key.side = sideRecv
	}
	return key
}

// consensusEvent is the event of a consensus command other than begin and
// in-flight.
func consensusEvent(t *testing.T, c *scriptCmd, key instKey) instEvent {
	switch c.name {
	case "done":
		res := rankResult{bytes: int64(c.int(t, "bytes", 0)), chunks: c.int(t, "chunks", 0), backend: c.str("backend", "")}
		if c.has("end") {
			res.end = scriptT0.Add(c.dur(t, "end", 0))
		}
		return rankDoneEvent{key: key, rank: c.int(t, "rank", 0), err: scriptErr(c, "err"), res: res, now: scriptAt(t, c)}
	case "cancel":
		return instCancelEvent{key: key, cause: fmt.Errorf("%w: %s", ErrCanceled, c.str("cause", "cancelled"))}
	case "start-failed":
		return startFailedEvent{key: key, ranks: c.ints(t, "ranks"), err: scriptErr(c, "err"), now: scriptAt(t, c)}
	case "attempt":
		// attempt send id= rank= attempt= [err=]: rank's part of the
		// attempt ended (err: the attempt failed).
		return attemptEndEvent{key: key, rank: c.int(t, "rank", 0), attempt: uint64(c.int(t, "attempt", 0)), err: scriptErr(c, "err")}
	case "join-begin":
		// join-begin send|recv id= ranks= [at=]: a process of a split
		// instance began the request (the first one enters it).
		return joinBeginEvent{key: key, ranks: c.ints(t, "ranks"), now: scriptAt(t, c)}
	case "ranks-lost":
		// ranks-lost send|recv ranks= err=: the process hosting ranks
		// left (the side word is unused).
		return ranksLostEvent{ranks: c.ints(t, "ranks"), err: scriptErr(c, "err"), now: scriptAt(t, c)}
	}
	t.Fatalf("%s: unknown command %s", c.pos, c.name)
	return nil
}

func effectLines(effs []instEffect) string {
	lines := make([]string, len(effs))
	for i, e := range effs {
		lines[i] = e.String()
	}
	return strings.Join(lines, "\n")
}

func (in *consensusInterp) run(t *testing.T, c *scriptCmd) string {
	key := scriptKey(t, c)
	switch c.name {
	case "begin":
		if err := in.c.begin(key, c.ints(t, "ranks"), scriptAt(t, c)); err != nil {
			return "error: " + err.Error()
		}
		return ""
	case "in-flight":
		all, reported := in.c.inFlight(key.side)
		return fmt.Sprintf("in flight: %d, reported by Check: %d", all, reported)
	case "begun-elsewhere":
		return begunLine(in.c, key, c.int(t, "rank", 0))
	}
	return effectLines(in.c.step(consensusEvent(t, c, key)))
}

// begunLine is the answer of begun-elsewhere send id= rank=: may an ask
// for the request reaching rank before rank holds it be held (askHold)?
func begunLine(c *consensus, key instKey, rank int) string {
	at, ok := c.begunElsewhere(key.id, rank)
	if !ok {
		return "not begun for rank " + fmt.Sprint(rank)
	}
	return fmt.Sprintf("begun for rank %d at=+%v", rank, at.Sub(scriptT0))
}

// TestDocScript: the script the package docs walk through is a real one.
func TestDocScript(t *testing.T) {
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	const from = "From\n// testdata/send/serve.script:\n//\n"
	i := strings.Index(string(doc), from)
	if i < 0 {
		t.Fatal("doc.go quotes no script")
	}
	var quoted []string
	for _, l := range strings.Split(string(doc)[i+len(from):], "\n") {
		if l == "//" {
			quoted = append(quoted, "")
			continue
		}
		if !strings.HasPrefix(l, "//\t") {
			break
		}
		quoted = append(quoted, strings.TrimPrefix(l, "//\t"))
	}
	script, err := os.ReadFile("testdata/send/serve.script")
	if err != nil {
		t.Fatal(err)
	}
	q := strings.TrimSpace(strings.Join(quoted, "\n"))
	if len(quoted) < 10 || !strings.Contains(string(script), q) {
		t.Errorf("the script in doc.go is not in testdata/send/serve.script:\n%s", q)
	}
}
