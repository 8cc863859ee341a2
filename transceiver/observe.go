package transceiver

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/mover"
)

// Roles of a rank in a transfer.
const (
	RoleContext    = "context"    // sends
	RoleGeneration = "generation" // receives
)

// Results of a transfer, as metrics label them.
const (
	ResultOK        = "ok"
	ResultError     = "error"
	ResultTimeout   = "timeout"
	ResultCancelled = "cancelled"
)

// Record describes one rank's part of one finished transfer.
type Record struct {
	RequestID uint64
	Rank      int
	Role      string // RoleContext or RoleGeneration
	Backend   string // what carried the data ("tcp"); "" when nothing moved
	// Bytes are the bytes moved; on the context side, by every pull
	// attempt of the request (a failed attempt ends no transfer: it is
	// logged, and the request waits for the next).
	Bytes int64
	// Delay is from the request entering the transceiver to its data
	// starting to move (waiting for the peer); Duration from then to the
	// end. A direct receive, which cannot see its data start, counts from
	// its request-info on: from then on it waits on the data plane. When
	// no data moved, Delay is the whole time and Duration 0.
	Delay, Duration time.Duration
	Chunks          int
	Result          string
	Err             error
}

// GBps is Bytes/Duration in 1e9 bytes per second.
func (r Record) GBps() float64 {
	if r.Duration <= 0 {
		return 0
	}
	return float64(r.Bytes) / r.Duration.Seconds() / 1e9
}

// Observer receives the transceiver's events, for metrics and logs. Its
// methods are called from the transceiver's goroutines, concurrently, and
// must not block.
type Observer interface {
	// TransferStarted is called when a rank starts its part of a transfer.
	TransferStarted(role string)
	// TransferEnded is called once per TransferStarted.
	TransferEnded(rec Record)
}

func resultOf(err error) string {
	switch {
	case err == nil:
		return ResultOK
	case errors.Is(err, ErrTimeout):
		return ResultTimeout
	case errors.Is(err, ErrCanceled):
		return ResultCancelled
	}
	return ResultError
}

// rankStats are the figures of one request on one rank.
type rankStats struct {
	rankResult           // what the instance is told
	start      time.Time // when the rank was handed the request
	moving     time.Time // when data started to move; zero if it never did
}

// add accounts what a send or a receive moved.
func (st *rankStats) add(m mover.Moved) {
	st.bytes += m.Bytes
	st.chunks += m.Chunks
	st.backend = m.Backend
}

func roleOf(s side) string {
	if s == sideSend {
		return RoleContext
	}
	return RoleGeneration
}

// report hands a finished transfer to the observer and the timing file.
func (r *rank) report(id uint64, role string, err error, st rankStats) {
	rec := st.record(id, r.idx, role, err)
	if r.obs != nil {
		r.obs.TransferEnded(rec)
	}
	r.csv.write(rec)
}

func (st rankStats) record(id uint64, rank int, role string, err error) Record {
	rec := Record{RequestID: id, Rank: rank, Role: role, Backend: st.backend, Bytes: st.bytes, Chunks: st.chunks,
		Result: resultOf(err), Err: err}
	if st.moving.IsZero() {
		rec.Delay = st.end.Sub(st.start)
	} else {
		rec.Delay, rec.Duration = st.moving.Sub(st.start), st.end.Sub(st.moving)
	}
	return rec
}

// timingCSV writes one CSV file per rank and role, like TensorRT-LLM's
// TRTLLM_KVCACHE_TIME_OUTPUT_PATH: a row per transfer.
type timingCSV struct {
	dir   string
	mu    sync.Mutex
	files map[string]*os.File
	err   error // first error, reported once
}

const csvHeader = "RequestID,Delay(ms),Duration(ms),Bytes,GB/s,Backend,Result\n"

func (c *timingCSV) write(rec Record) {
	if c == nil {
		return
	}
	dir := "send"
	if rec.Role == RoleGeneration {
		dir = "recv"
	}
	name := filepath.Join(c.dir, fmt.Sprintf("kvxfer_%d_rank%d_%s.csv", os.Getpid(), rec.Rank, dir))
	c.mu.Lock()
	defer c.mu.Unlock()
	f := c.files[name]
	if f == nil && c.err == nil {
		var err error
		if err = os.MkdirAll(c.dir, 0o755); err == nil {
			f, err = os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
		}
		if err != nil {
			c.err = err
			return
		}
		f.WriteString(csvHeader)
		c.files[name] = f
	}
	if f == nil {
		return
	}
	fmt.Fprintf(f, "%d,%.3f,%.3f,%d,%.3f,%s,%s\n", rec.RequestID, ms(rec.Delay), ms(rec.Duration), rec.Bytes, rec.GBps(), rec.Backend, rec.Result)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func (c *timingCSV) close() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	errs := []error{c.err}
	for _, f := range c.files {
		errs = append(errs, f.Close())
	}
	c.files = map[string]*os.File{}
	return errors.Join(errs...)
}
