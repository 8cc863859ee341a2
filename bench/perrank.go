package bench

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/layout"
)

// --process-per-rank: every rank of both instances is an OS process of its
// own, as engines run them (one process per GPU rank); the processes of an
// instance agree through a transceiver.CoordinatedGroup, the process of
// rank 0 coordinating. This process only drives them: it has each context
// process prefill its rank's share of a request (the opaque state of the
// first is handed to the generation side; they are the same but for
// their nonces), each generation process pull into its rank's blocks, and
// collects what they measured. Verification (--verify) runs in each
// generation process, on its rank's blocks, against the same reference.
//
// The cost of the cross-process consensus is Stats.Agreement: in a
// process, from the end of the instance's last rank's part of a request
// to the moment the process completed it, one trip through the group's
// log (the ranks' ends are stamped on their processes' clocks: one
// machine here). The generation side's figure of a request is the largest
// of its processes'; the context side's are every context process's.

// rankProcs are the processes of one instance.
type rankProcs []*peerProc

// startInstance starts one process per rank of st, the one of rank 0
// first (it tells where it listens as the coordinator).
func startInstance(ctx context.Context, c *Config, role string, st layout.CacheState, setup peerSetup) (rankProcs, error) {
	n := st.Parallel.NumRanks()
	setup.Role, setup.Group = role, &groupSetup{Processes: n}
	var procs rankProcs
	for r := range n {
		s := setup
		s.Ranks = []int{r}
		p, err := spawnPeer(ctx, *c, s, &st)
		if err != nil {
			procs.stop()
			return nil, err
		}
		procs = append(procs, p)
		if r == 0 && n > 1 {
			m, err := p.read()
			if err == nil && (m.Op != "listening" || len(m.Endpoints) != 1) {
				err = fmt.Errorf("bench: %s rank 0: %s %s", role, m.Op, m.Error)
			}
			if err != nil {
				procs.stop()
				return nil, err
			}
			setup.Group.Coordinator = m.Endpoints[0]
		}
	}
	for _, p := range procs {
		if err := p.waitReady(); err != nil {
			procs.stop()
			return nil, err
		}
	}
	return procs, nil
}

func (ps rankProcs) stop() {
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Add(1)
		go func() { defer wg.Done(); p.stop() }()
	}
	wg.Wait()
}

// all sends m to every process, then reads every answer.
func (ps rankProcs) all(m peerMsg) ([]peerMsg, error) {
	for _, p := range ps {
		if err := p.send(m); err != nil {
			return nil, err
		}
	}
	out := make([]peerMsg, len(ps))
	var errs []error
	for i, p := range ps {
		a, err := p.read()
		if err != nil {
			return nil, err
		}
		if a.Error != "" {
			errs = append(errs, fmt.Errorf("%s: %s", p.role(), a.Error))
		}
		out[i] = a
	}
	return out, errors.Join(errs...)
}

// quit tells process i to quit and returns its bye.
func (ps rankProcs) quit(i int) (peerMsg, error) {
	bye, err := ps[i].quit()
	if err == nil && bye.Op != "bye" {
		err = fmt.Errorf("bench: %s process: answered quit with %q %s", ps[i].role(), bye.Op, bye.Error)
	}
	return bye, err
}

// perRankRun is a --process-per-rank run under way.
type perRankRun struct {
	c        *Config
	nb       int
	verifyOn bool
	ctx, gen rankProcs
	nextID   uint64

	res      *Result
	lat      []float64 // ms
	agree    []float64 // generation side, µs, largest of the processes per request
	backends []string
	measured time.Duration
}

// runPerRank is Run under --process-per-rank.
func runPerRank(ctx context.Context, c *Config, m Model, cs, gs layout.CacheState) (*Result, error) {
	r := &perRankRun{c: c, nb: layout.NumBlocks(c.ISL, c.TokensPerBlock), verifyOn: c.Verify && verifiable(cs, c.ISL), nextID: 1}
	poolBlocks := r.nb * c.Concurrency
	if err := checkMemory(cs, gs, poolBlocks, c.ISL, r.verifyOn); err != nil {
		return nil, err
	}
	if c.TLS {
		return nil, errors.New("bench: --process-per-rank does not run with --tls yet")
	}
	setup := peerSetup{Backend: c.Backend, PoolBlocks: poolBlocks, ReferenceFill: r.verifyOn, MaxTokensInBuf: c.MaxTokensInBuffer}
	var err error
	if r.ctx, err = startInstance(ctx, c, "context", cs, setup); err != nil {
		return nil, err
	}
	defer r.ctx.stop()
	if r.gen, err = startInstance(ctx, c, "generation", gs, setup); err != nil {
		return nil, err
	}
	defer r.gen.stop()

	r.res = c.measuredResult(m, cs, r.verifyOn)
	r.res.ProcessPerRank = true
	if c.runBatches(func(n int, warm bool) bool {
		err := r.batch(n, warm)
		if err != nil {
			r.res.fail(err)
		}
		return err == nil
	}) {
		r.finish()
	}
	return r.res, nil
}

// batch moves n requests at once.
func (r *perRankRun) batch(n int, warm bool) error {
	type pending struct {
		id, seed uint64
		opaque   string
	}
	reqs := make([]pending, n)
	for i := range reqs {
		id := r.nextID
		r.nextID++
		reqs[i] = pending{id: id, seed: id*7919 + 17}
		answers, err := r.ctx.all(peerMsg{Op: "prepare", ID: id, Tokens: r.c.ISL, Seed: reqs[i].seed})
		if err != nil {
			return fmt.Errorf("bench: context side: %w", err)
		}
		reqs[i].opaque = answers[0].Opaque
		if _, err := base64.StdEncoding.DecodeString(reqs[i].opaque); err != nil {
			return fmt.Errorf("bench: context rank 0's opaque state: %w", err)
		}
	}
	t0 := time.Now()
	for _, q := range reqs {
		if _, err := r.gen.all(peerMsg{Op: "receive", ID: q.id, Tokens: r.c.ISL, Seed: q.seed, Opaque: q.opaque}); err != nil {
			r.res.addError(err.Error())
		}
	}
	answers, err := r.gen.all(peerMsg{Op: "collect"})
	if err != nil {
		return err
	}
	elapsed := time.Since(t0)
	byID := map[uint64][]rankResult{}
	for _, a := range answers {
		for _, res := range a.Results {
			byID[res.ID] = append(byID[res.ID], res)
		}
	}
	// Checked after the clock stopped, as Run checks its own.
	checked, err := r.gen.all(peerMsg{Op: "check", Tokens: r.c.ISL})
	if err != nil {
		return err
	}
	for _, a := range checked {
		for _, res := range a.Results {
			r.res.addError(res.Error)
		}
	}
	for _, q := range reqs {
		r.account(q.id, byID[q.id], warm)
	}
	if !warm {
		r.measured += elapsed
	}
	return nil
}

// account records one request from what every generation process saw.
func (r *perRankRun) account(id uint64, res []rankResult, warm bool) {
	if len(res) != len(r.gen) {
		r.res.addError(fmt.Sprintf("request %d: %d of %d generation processes reported it", id, len(res), len(r.gen)))
		return
	}
	var bytes int64
	var dur, agree time.Duration
	ok := true
	for _, x := range res {
		if x.Error != "" {
			r.res.addError(x.Error)
			ok = false
			continue
		}
		if x.Backend != "" && !slices.Contains(r.backends, x.Backend) {
			r.backends = append(r.backends, x.Backend)
		}
		bytes = max(bytes, x.Bytes) // each process reports the instance's total
		dur = max(dur, time.Duration(x.DurationNs))
		agree = max(agree, time.Duration(x.AgreementNs))
	}
	if ok && !warm {
		r.res.Bytes += bytes
		r.res.BytesPerReq = bytes
		r.lat = append(r.lat, float64(dur)/float64(time.Millisecond))
		r.agree = append(r.agree, float64(agree)/float64(time.Microsecond))
	}
}

// finish computes the figures and collects the processes' counts.
func (r *perRankRun) finish() {
	res := r.res
	res.Backend = strings.Join(r.backends, "+")
	res.Requests = len(r.lat)
	res.MeasuredS = r.measured.Seconds()
	if r.measured > 0 {
		res.GBps = float64(res.Bytes) / r.measured.Seconds() / 1e9
		res.TransfersPerS = float64(res.Requests) / r.measured.Seconds()
	}
	res.P50Ms, res.P99Ms = percentile(r.lat, 50), percentile(r.lat, 99)
	res.AgreementP50Us, res.AgreementP99Us = percentile(r.agree, 50), percentile(r.agree, 99)
	res.lat, res.agree = r.lat, r.agree
	var ctxAgree []float64
	for _, ps := range []rankProcs{r.ctx, r.gen} {
		// One at a time, each bye read before the next process exits (its
		// pipe is closed once it has), the coordinator last, so that no
		// process leaves the group while another still has requests of it
		// to see end.
		for i := len(ps) - 1; i >= 0; i-- {
			bye, err := ps.quit(i)
			if err != nil {
				res.addError(err.Error())
				continue
			}
			res.PeerFailed += bye.Failed
			res.PeerLeaked += bye.Leaked
			if bye.Leaked != 0 {
				res.addError(fmt.Sprintf("%s: %d blocks still held at the end", ps[i].role(), bye.Leaked))
			}
			for _, a := range bye.Agreements {
				ctxAgree = append(ctxAgree, float64(a)/float64(time.Microsecond))
			}
		}
	}
	res.CtxAgreementP50Us, res.CtxAgreementP99Us = percentile(ctxAgree, 50), percentile(ctxAgree, 99)
	res.ctxAgree = ctxAgree
	if res.Errors > 0 && r.verifyOn {
		res.Verified, res.Verification = false, VerifyFailed
	}
}
