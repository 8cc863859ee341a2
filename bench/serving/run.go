package serving

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// ErrBadOptions: options Run cannot run with.
var ErrBadOptions = errors.New("serving: bad options")

// Target is what a run measures.
type Target struct {
	// Name labels it: "disaggregated" (a router), "aggregated" (a worker
	// of role both) or "url".
	Name string `json:"name"`
	URL  string `json:"url"`
	// Cluster is the cluster file kvxfer started the target from, when a
	// run compares several (kvxfer bench serve -f a.yaml -f b.yaml).
	Cluster string `json:"cluster,omitempty"`
}

// Short names the target in labels: the cluster file's base name
// without its extension when it has one, else Name.
func (t Target) Short() string {
	if t.Cluster == "" {
		return t.Name
	}
	base := filepath.Base(t.Cluster)
	if t.Name != TargetDisaggregated {
		return strings.TrimSuffix(base, filepath.Ext(base)) + " " + t.Name
	}
	return strings.TrimSuffix(base, filepath.Ext(base))
}

// Options configure one run.
type Options struct {
	Target   Target
	Workload Workload
	// Model is the request's model field ("" leaves it out).
	Model string
	// Rate is the conversations started per second (with one turn, the
	// request rate); 0 or +Inf starts them all at once. Burstiness is the
	// gamma shape of the gaps (1: Poisson).
	Rate, Burstiness float64
	// MaxConcurrency bounds the requests in flight; 0 is no bound.
	MaxConcurrency int
	// Duration stops sending new requests once it has passed; 0 is no
	// bound. Requests in flight then finish.
	Duration time.Duration
	// Warmup requests are sent one after the other before the run, from
	// a workload of their own (the same lengths, another seed), and not
	// measured: they open the connections (HTTP, and the KV transfer's
	// between the workers) that the first measured requests would
	// otherwise wait for.
	Warmup int
	// Timeout bounds each request; 0 is DefaultTimeout.
	Timeout time.Duration
	// TokensPerBlock is the servers' KV block size in tokens, for the
	// bench's own count of each turn's new blocks (NewBlocks); 0 counts
	// none.
	TokensPerBlock int
	// ConversationField is where each request carries its
	// conversation's id (ConversationField*; "" is ConversationFieldTop).
	// The id is unique to the run and the conversation.
	ConversationField string
	SLO               SLO
	// Client sends the requests; nil is a client of its own, closed by
	// Run.
	Client *http.Client
	// Progress, when set, is called as requests end (from several
	// goroutines, never at once).
	Progress func(done, total int)
}

// DefaultTimeout bounds a request when Options.Timeout is 0.
const DefaultTimeout = 5 * time.Minute

// validate reports every problem with o at once.
func (o *Options) validate() error {
	errs := []error{o.Workload.Validate()}
	if o.Target.URL == "" {
		errs = append(errs, fmt.Errorf("%w: no target URL", ErrBadOptions))
	}
	if o.Rate < 0 || math.IsNaN(o.Rate) {
		errs = append(errs, fmt.Errorf("%w: request rate %v, want > 0 (or inf)", ErrBadOptions, o.Rate))
	}
	if !(o.Burstiness > 0) || math.IsInf(o.Burstiness, 0) {
		errs = append(errs, fmt.Errorf("%w: burstiness %v, want a finite number > 0", ErrBadOptions, o.Burstiness))
	}
	if o.MaxConcurrency < 0 {
		errs = append(errs, fmt.Errorf("%w: max concurrency %d, want 0 (no bound) or more", ErrBadOptions, o.MaxConcurrency))
	}
	if o.Warmup < 0 {
		errs = append(errs, fmt.Errorf("%w: warm-up of %d requests, want 0 or more", ErrBadOptions, o.Warmup))
	}
	if o.TokensPerBlock < 0 {
		errs = append(errs, fmt.Errorf("%w: tokens per block %d, want 0 (no block accounting) or more", ErrBadOptions, o.TokensPerBlock))
	}
	switch o.ConversationField {
	case "", ConversationFieldTop, ConversationFieldDisagg, ConversationFieldNone:
	default:
		errs = append(errs, fmt.Errorf("%w: conversation id field %q, want %s, %s or %s", ErrBadOptions, o.ConversationField,
			ConversationFieldTop, ConversationFieldDisagg, ConversationFieldNone))
	}
	if o.Duration < 0 || o.Timeout < 0 {
		errs = append(errs, fmt.Errorf("%w: duration %v and timeout %v may not be negative", ErrBadOptions, o.Duration, o.Timeout))
	}
	return errors.Join(errs...)
}

// Run sends o's workload to o's target and returns a record per request
// sent (in the order of conversations and turns) and the run's length,
// from its start to the end of its last request. Conversations start at
// Arrivals' offsets; a conversation's turns follow each other, each sent
// when the answer to the one before has come, with its history. A turn
// whose predecessor failed is not sent. Run returns when every request
// sent has ended; ctx ends it early (requests in flight end as canceled).
func Run(ctx context.Context, o Options) ([]Record, time.Duration, error) {
	if err := o.validate(); err != nil {
		return nil, 0, err
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	client := o.Client
	if client == nil {
		client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024}}
		defer client.CloseIdleConnections()
	}
	system := o.Workload.SystemPrompt()
	if err := warmup(ctx, client, &o, system); err != nil {
		return nil, 0, err
	}
	convs := o.Workload.Conversations()
	starts := Arrivals(o.Workload.Seed, len(convs), o.Rate, o.Burstiness)
	var sem chan struct{}
	if o.MaxConcurrency > 0 {
		sem = make(chan struct{}, o.MaxConcurrency)
	}
	d := &driver{o: &o, client: client, system: system, sem: sem, start: time.Now(), total: o.Workload.NumPrompts, runID: newRunID()}
	results := make([][]Record, len(convs))
	var wg sync.WaitGroup
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
launch:
	for i := range convs {
		if wait := starts[i] - time.Since(d.start); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				break launch
			case <-timer.C:
			}
		}
		if d.expired() || ctx.Err() != nil {
			break
		}
		wg.Go(func() { results[i] = d.conversation(ctx, i, convs[i]) })
	}
	wg.Wait()
	var out []Record
	last := time.Duration(0)
	for _, rs := range results {
		for _, r := range rs {
			last = max(last, r.Sent+r.E2EL)
			out = append(out, r)
		}
	}
	return out, last, nil
}

// warmup sends o.Warmup single-turn requests one after the other. It
// fails only when ctx ends.
func warmup(ctx context.Context, c *http.Client, o *Options, system []int32) error {
	if o.Warmup == 0 {
		return nil
	}
	w := o.Workload
	w.Seed, w.NumPrompts, w.Turns = w.Seed^0x3a53_a3f1_0d1e_55aa, o.Warmup, 1
	for _, conv := range w.Conversations() {
		rctx, cancel := context.WithTimeout(ctx, o.Timeout)
		send(rctx, c, o.Target.URL, request{Model: o.Model, Prompt: Prompt(system, conv, 0, nil), MaxTokens: conv.Turns[0].MaxTokens})
		cancel()
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("serving: warm-up of %s: %w", o.Target.URL, err)
		}
	}
	return nil
}

// newRunID returns a random id that makes a run's conversation ids its
// own: a router that keeps conversations on workers must not take a
// conversation of one run for one of another.
func newRunID() string { return fmt.Sprintf("%016x", rand.Uint64()) }

// driver is the state a run's conversations share.
type driver struct {
	o      *Options
	client *http.Client
	system []int32
	sem    chan struct{}
	start  time.Time
	total  int
	runID  string

	mu   sync.Mutex
	done int
}

func (d *driver) expired() bool {
	return d.o.Duration > 0 && time.Since(d.start) >= d.o.Duration
}

// conversation sends c's turns one after the other and returns their
// records: each turn after the answer to the one before has come, with
// the history that answer completes, and the conversation's id.
func (d *driver) conversation(ctx context.Context, idx int, c Conversation) []Record {
	var out []Record
	answers := make([][]int32, 0, len(c.Turns))
	field := d.o.ConversationField
	if field == "" {
		field = ConversationFieldTop
	}
	convID := ""
	if field != ConversationFieldNone {
		convID = fmt.Sprintf("kvxfer-bench-%s-%d", d.runID, idx)
	}
	var held []int32 // what the previous turn left cached (HeldTokens)
	for t, turn := range c.Turns {
		if t > 0 && d.expired() {
			break
		}
		if d.sem != nil {
			select {
			case d.sem <- struct{}{}:
			case <-ctx.Done():
				return out
			}
		}
		// A start that waited for a slot past Duration is not sent.
		if ctx.Err() != nil || d.expired() {
			if d.sem != nil {
				<-d.sem
			}
			break
		}
		prompt := Prompt(d.system, c, t, answers)
		rec := Record{Conversation: idx, Turn: t, Sent: time.Since(d.start), PromptTokens: len(prompt), MaxTokens: turn.MaxTokens,
			PromptBlocks: Blocks(len(prompt), d.o.TokensPerBlock), NewBlocks: NewBlocks(held, prompt, d.o.TokensPerBlock)}
		rctx, cancel := context.WithTimeout(ctx, d.o.Timeout)
		a, err := send(rctx, d.client, d.o.Target.URL, request{Model: d.o.Model, Prompt: prompt, MaxTokens: turn.MaxTokens,
			ConversationID: convID, Field: field})
		cancel()
		if d.sem != nil {
			<-d.sem
		}
		rec.TTFT, rec.E2EL, rec.ITL, rec.Timing, rec.Path = a.ttft, a.e2el, a.itl, a.timing, a.path
		rec.CachedTokens, rec.HasCached = max(a.cached, 0), a.cached >= 0
		rec.OutputTokens = len(a.ids)
		if a.usage >= 0 {
			rec.OutputTokens = a.usage
		}
		var re *RequestError
		if errors.As(err, &re) {
			rec.ErrorKind, rec.Error = re.Kind, re.Err.Error()
			if rec.E2EL == 0 {
				rec.E2EL = time.Since(d.start) - rec.Sent
			}
		}
		out = append(out, rec)
		d.progress()
		if err != nil {
			break
		}
		answers = append(answers, a.ids)
		held = HeldTokens(prompt, a.ids)
	}
	return out
}

func (d *driver) progress() {
	if d.o.Progress == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.done++
	d.o.Progress(d.done, d.total)
}

// RunPaired sends each conversation of o's workload to every target, one
// request at a time: the whole conversation to one target, then to the
// next, the targets' order rotating from one conversation to the next
// (A B, B A, ...). It returns each target's records and the time spent on
// its requests. Paired runs compare targets on a machine whose load
// drifts: each target gets the same prompts under the same conditions, a
// few hundred milliseconds apart, rather than in runs minutes apart.
// o.Rate and o.MaxConcurrency are not used; o.Duration bounds the whole.
func RunPaired(ctx context.Context, o Options, targets []Target) ([][]Record, []time.Duration, error) {
	if len(targets) == 0 {
		return nil, nil, fmt.Errorf("%w: a paired run needs a target", ErrBadOptions)
	}
	for _, t := range targets {
		ot := o
		ot.Target = t
		if err := ot.validate(); err != nil {
			return nil, nil, err
		}
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	client := o.Client
	if client == nil {
		client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
		defer client.CloseIdleConnections()
	}
	system := o.Workload.SystemPrompt()
	start := time.Now()
	drivers := make([]*driver, len(targets))
	for i, t := range targets {
		ot := o
		ot.Target, ot.Progress = t, nil
		if err := warmup(ctx, client, &ot, system); err != nil {
			return nil, nil, err
		}
		drivers[i] = &driver{o: &ot, client: client, system: system, start: start, runID: newRunID()}
	}
	records := make([][]Record, len(targets))
	spent := make([]time.Duration, len(targets))
	done, total := 0, o.Workload.NumPrompts*len(targets)
	for i, conv := range o.Workload.Conversations() {
		if ctx.Err() != nil || (o.Duration > 0 && time.Since(start) >= o.Duration) {
			break
		}
		for k := range targets {
			t := (i + k) % len(targets)
			before := time.Now()
			rs := drivers[t].conversation(ctx, i, conv)
			spent[t] += time.Since(before)
			records[t] = append(records[t], rs...)
			done += len(rs)
			if o.Progress != nil {
				o.Progress(done, total)
			}
		}
	}
	return records, spent, nil
}
