package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/freeport"
	"github.com/kvxfer/kvxfer/transport"
)

// The baselines' names.
const (
	BaselineCopy        = "copy"
	BaselineCopy2       = "copy_2threads"
	BaselineRawTCP      = "raw_tcp"
	BaselineIperf3      = "iperf3"
	BaselineIperf3Multi = "iperf3_multi"
	BaselineUCXPerftest = "ucx_perftest"
	BaselineOpenSSL     = "openssl_aes_128_gcm"
)

// Baseline is one of the machine's own limits, measured in the same run as
// the transfers so that ratios between them mean something on a noisy
// machine. A baseline that could not be measured has GBps 0 and says why
// in Skipped (the tool is not installed) or Error (it failed).
type Baseline struct {
	Name        string  `json:"name"` // BaselineCopy, BaselineRawTCP, BaselineIperf3, BaselineUCXPerftest, BaselineUCXC, BaselineOpenSSL, ...
	Description string  `json:"description"`
	GBps        float64 `json:"gbps"`  // 1e9 bytes per second
	Bytes       int64   `json:"bytes"` // moved per measurement
	// Backends are the kvxfer backends whose runs are compared with this
	// baseline (by the backend that actually carried the data).
	Backends []string `json:"backends"`
	Command  string   `json:"command,omitempty"` // an external tool's client command line
	Skipped  string   `json:"skipped,omitempty"`
	Error    string   `json:"error,omitempty"`
	// Variants are the settings tried, when the baseline is the best of
	// several (iperf3's write lengths, Go's copy and C's memcpy); Best
	// names the winner, whose figure and command are the baseline's.
	Variants []Variant `json:"variants,omitempty"`
	Best     string    `json:"best,omitempty"`
	// Rounds are its figure in each round of the sweep (Sweep.Rounds), in
	// order, each the best setting of that round's search; GBps is the best
	// of them, and with several rounds Variants and Best are the search of
	// the round that gave it. A baseline skipped has none; one that failed
	// in the first round is not measured again.
	Rounds []BaselineRound `json:"rounds,omitempty"`
}

// Variant is one setting a baseline was measured with.
type Variant struct {
	Setting string  `json:"setting"`
	GBps    float64 `json:"gbps"`            // 0 when it failed
	Bytes   int64   `json:"bytes,omitempty"` // moved, when not the baseline's Bytes
	Command string  `json:"command,omitempty"`
	Error   string  `json:"error,omitempty"`
}

// pickBest makes the best of b.Variants b's figure. When none was
// measured, b.Error says why each failed.
func (b *Baseline) pickBest() {
	if len(b.Variants) == 0 && b.Error == "" && b.Skipped == "" {
		b.Error = "no setting was measured"
		return
	}
	var errs []string
	for _, v := range b.Variants {
		if v.GBps > b.GBps {
			b.GBps, b.Best, b.Command = v.GBps, v.Setting, v.Command
			if v.Bytes > 0 {
				b.Bytes = v.Bytes
			}
		}
		if v.Error != "" {
			errs = append(errs, v.Setting+": "+v.Error)
		}
	}
	if b.GBps <= 0 && b.Error == "" {
		b.Error = strings.Join(errs, "; ")
	}
}

// Ratio is a run's GB/s over a baseline's.
type Ratio struct {
	Baseline string  `json:"baseline"`
	Ratio    float64 `json:"ratio"`
}

// baselineBackends maps a backend that carried data (its name, or its name
// before any "(detail)") to the baselines it is compared with. tcp over TLS
// is also compared with the cipher's limit on one core.
var baselineBackends = map[string][]string{
	"tcp":      {BaselineRawTCP, BaselineIperf3, BaselineIperf3Multi},
	"tcp(tls)": {BaselineRawTCP, BaselineIperf3, BaselineIperf3Multi, BaselineOpenSSL},
	"shm":      {BaselineCopy, BaselineCopy2},
	"ucx":      {BaselineUCXPerftest, BaselineUCXC},
	"mpi":      {BaselineMPI},
}

func backendsOf(baseline string) []string {
	var out []string
	for _, b := range []string{"tcp", "tcp(tls)", "shm", "ucx", "mpi"} {
		for _, n := range baselineBackends[b] {
			if n == baseline {
				out = append(out, b)
			}
		}
	}
	return out
}

// ratios returns r's ratios to the measured baselines that apply to the
// backend that carried its data.
func ratios(r *Result, bs []Baseline) []Ratio {
	if r.GBps <= 0 || r.Backend == "" || strings.Contains(r.Backend, "+") {
		return nil
	}
	names, ok := baselineBackends[r.Backend]
	if !ok {
		kind, _, _ := strings.Cut(r.Backend, "(")
		names = baselineBackends[kind]
	}
	var out []Ratio
	for _, name := range names {
		for _, b := range bs {
			if b.Name == name && b.GBps > 0 {
				out = append(out, Ratio{Baseline: name, Ratio: r.GBps / b.GBps})
			}
		}
	}
	return out
}

// baselineRunner measures the baselines of a sweep.
type baselineRunner struct {
	cfg      Config // for the peer process
	bytes    int64
	lookPath func(string) (string, error)
	timeout  time.Duration // per external tool
	report   func(b Baseline, round int)
	tls      bool // some runs use TLS: measure the cipher's limit too
	ucx      bool // some runs use backend ucx: measure ucx_perftest and the C UCP program too
	mpi      bool // some runs use backend mpi: measure the C MPI program too
	mpiBTL   string
	// unmeasured are the baselines the first round skipped or could not
	// measure.
	unmeasured map[string]bool
}

// baselineMeasure is one baseline of a sweep: its name and how a round
// measures it.
type baselineMeasure struct {
	name    string
	measure func(context.Context) Baseline
}

// measures are the baselines of the sweep in the order each round
// measures them: the machine's limits when all (Sweep.Baseline), those of
// the backends that some run uses, and the cipher's limit when some run
// uses TLS.
func (br *baselineRunner) measures(all bool) []baselineMeasure {
	var out []baselineMeasure
	add := func(name string, f func(context.Context) Baseline) { out = append(out, baselineMeasure{name, f}) }
	if all {
		add(BaselineCopy, func(context.Context) Baseline { return copyBaseline(br.bytes, 1) })
		add(BaselineCopy2, func(context.Context) Baseline { return copyBaseline(br.bytes, 2) })
		add(BaselineRawTCP, br.raw)
		add(BaselineIperf3, func(ctx context.Context) Baseline { return br.iperf3(ctx, 1) })
		add(BaselineIperf3Multi, func(ctx context.Context) Baseline { return br.iperf3(ctx, transport.DefaultStreams) })
		if br.ucx {
			add(BaselineUCXPerftest, br.ucxPerftest)
			add(BaselineUCXC, br.ucxC)
		}
		if br.mpi {
			add(BaselineMPI, br.mpiBaseline)
		}
	}
	if br.tls {
		add(BaselineOpenSSL, br.openssl)
	}
	return out
}

// round measures each of ms once, round k of a sweep (0-based), and
// returns them. Every round tries every setting of each baseline (its
// figure in the round is its best setting's), so that no round measures
// the reference tool with a setting that won an earlier round only by
// chance; later rounds do not measure again a baseline that round 0
// skipped or could not measure.
func (br *baselineRunner) round(ctx context.Context, ms []baselineMeasure, k int) []Baseline {
	if k == 0 {
		br.unmeasured = map[string]bool{}
	}
	var out []Baseline
	for _, m := range ms {
		if k > 0 && br.unmeasured[m.name] {
			continue
		}
		b := m.measure(ctx)
		b.Backends = backendsOf(b.Name)
		if k == 0 {
			br.unmeasured[m.name] = b.GBps <= 0
		}
		out = append(out, b)
		br.report(b, k)
	}
	return out
}

// raw is the raw TCP baseline: one stream from the context process.
func (br *baselineRunner) raw(ctx context.Context) Baseline {
	b := Baseline{Name: BaselineRawTCP, Description: "one TCP stream over loopback from the context process to this one, read through a 4 MiB buffer (best of 3)", Bytes: br.bytes}
	if gbps, err := br.rawTCP(ctx); err != nil {
		b.Error = err.Error()
	} else {
		b.GBps = gbps
	}
	return b
}

// opensslArgs is the openssl command of the cipher baseline: AES-128-GCM
// through the EVP interface (AES-NI and carry-less multiply when the CPU
// has them), on 16 KiB blocks, the size of a full TLS record, for one
// second, on one core.
var opensslArgs = []string{"speed", "-evp", "aes-128-gcm", "-seconds", "1", "-bytes", "16384"}

// openssl runs `openssl speed -evp aes-128-gcm`, the per-core limit of the
// cipher a TLS 1.3 connection between two Go processes uses on CPUs with AES
// instructions. Each TLS stream encrypts on one core and decrypts on
// another, so one stream cannot beat it.
func (br *baselineRunner) openssl(ctx context.Context) Baseline {
	b := Baseline{Name: BaselineOpenSSL, Description: "openssl speed, AES-128-GCM (the TLS 1.3 cipher) on 16 KiB blocks, one core"}
	exe, err := br.lookPath("openssl")
	if err != nil {
		b.Skipped = "openssl is not installed (Debian package openssl)"
		return b
	}
	ctx, cancel := context.WithTimeout(ctx, br.timeout)
	defer cancel()
	args := opensslArgs
	out, err := exec.CommandContext(ctx, exe, args...).Output()
	if err != nil && ctx.Err() == nil {
		// An openssl without -bytes (LibreSSL): every block size, the
		// largest last.
		args = args[:len(args)-2]
		out, err = exec.CommandContext(ctx, exe, args...).Output()
	}
	b.Command = "openssl " + strings.Join(args, " ")
	if err != nil {
		b.Error = fmt.Sprintf("%v: %s", err, tail(out))
		return b
	}
	block, gbps, err := parseOpenSSLSpeed(out)
	if err != nil {
		b.Error = err.Error()
		return b
	}
	b.GBps = gbps
	b.Bytes = int64(gbps * 1e9) // in its one second
	if block != 16384 {
		b.Description = fmt.Sprintf("openssl speed, AES-128-GCM (the TLS 1.3 cipher) on %d-byte blocks, one core", block)
	}
	return b
}

// parseOpenSSLSpeed reads the figure of the largest block size from the
// table of `openssl speed -evp aes-128-gcm`: a header line "type 16 bytes
// 64 bytes ..." and a line "AES-128-GCM 44321.22k ...", in 1000s of bytes
// per second.
func parseOpenSSLSpeed(out []byte) (block int, gbps float64, err error) {
	var sizes []int
	var rates []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 3 && f[0] == "type":
			sizes = sizes[:0]
			for i := 1; i+1 < len(f); i += 2 {
				n, err := strconv.Atoi(f[i])
				if err != nil || f[i+1] != "bytes" {
					break
				}
				sizes = append(sizes, n)
			}
		case len(f) >= 2 && strings.EqualFold(f[0], "aes-128-gcm"):
			rates = f[1:]
		}
	}
	if len(rates) == 0 || len(sizes) == 0 {
		return 0, 0, fmt.Errorf("openssl speed output has no AES-128-GCM table: %s", tail(out))
	}
	if len(rates) != len(sizes) {
		return 0, 0, fmt.Errorf("openssl speed output: %d block sizes but %d figures", len(sizes), len(rates))
	}
	last := rates[len(rates)-1]
	v, err := strconv.ParseFloat(strings.TrimSuffix(last, "k"), 64)
	if err != nil || v <= 0 {
		return 0, 0, fmt.Errorf("openssl speed output: figure %q", last)
	}
	return sizes[len(sizes)-1], v * 1000 / 1e9, nil
}

func (br *baselineRunner) rawTCP(ctx context.Context) (float64, error) {
	p, err := startPeer(ctx, br.cfg, peerSetup{}, nil)
	if err != nil {
		return 0, err
	}
	defer p.stop()
	gbps, err := p.rawTCP(br.bytes, 3)
	if err != nil {
		return 0, err
	}
	if _, err := p.quit(); err != nil {
		return 0, err
	}
	return gbps, nil
}

// iperf3Lengths are the write lengths (-l) the iperf3 baselines try: its
// default for TCP, and the larger writes that suit loopback. (iperf3 3.12
// refuses lengths above 1 MiB; the variant then records its refusal.)
var iperf3Lengths = []string{"128K", "1M", "4M"}

// iperf3Tries is how many times each write length runs: the first also
// warms up (connection set-up, page cache of the binary, the CPU's clock),
// and one stream's rate on this kind of shared machine swings by a third
// between runs minutes apart, so a single run understates the limit.
const iperf3Tries = 2

// iperf3 runs `iperf3 -s -1` and `iperf3 -c ... -n BYTES -l LEN -P
// streams -J` over loopback iperf3Tries times for each of iperf3Lengths:
// a length's figure is the best of its tries, the baseline the best
// length's, the receiver's rate summed over the streams. A length iperf3
// refuses is not tried again.
func (br *baselineRunner) iperf3(ctx context.Context, streams int) Baseline {
	b := Baseline{Name: BaselineIperf3, Description: fmt.Sprintf("iperf3, one TCP stream over loopback (receiver's rate), best write length, best of %d runs each", iperf3Tries), Bytes: br.bytes}
	if streams > 1 {
		b.Name = BaselineIperf3Multi
		b.Description = fmt.Sprintf("iperf3, %d TCP streams over loopback as the tcp backend opens (receivers' rate summed), best write length, best of %d runs each", streams, iperf3Tries)
	}
	exe, err := br.lookPath("iperf3")
	if err != nil {
		b.Skipped = "iperf3 is not installed (Debian package iperf3)"
		return b
	}
	for _, l := range iperf3Lengths {
		v := Variant{Setting: "-l " + l}
		for range iperf3Tries {
			gbps, cmd, err := br.iperf3Once(ctx, exe, l, streams)
			v.Command = cmd
			if err != nil {
				v.Error = firstLine(err.Error())
				break
			}
			v.GBps = max(v.GBps, gbps)
		}
		if v.GBps > 0 {
			v.Error = "" // a failed try after a measured one: the measured one counts
		}
		b.Variants = append(b.Variants, v)
	}
	b.pickBest()
	return b
}

// iperf3Once runs one iperf3 server and client with write length l and
// returns the receiver's rate and the client's command.
func (br *baselineRunner) iperf3Once(ctx context.Context, exe, l string, streams int) (float64, string, error) {
	port, err := freeport.Port()
	if err != nil {
		return 0, "", err
	}
	p := strconv.Itoa(port)
	client := []string{exe, "-c", "127.0.0.1", "-p", p, "-n", strconv.FormatInt(br.bytes, 10), "-l", l}
	if streams > 1 {
		client = append(client, "-P", strconv.Itoa(streams))
	}
	client = append(client, "-J")
	cmd := "iperf3 " + strings.Join(client[1:], " ")
	out, err := br.serverClient(ctx, []string{exe, "-s", "-1", "-p", p}, client)
	if err != nil {
		if line := toolLine(out, "iperf3: "); line != "" {
			err = errors.New(line) // iperf3's own words
		}
		return 0, cmd, err
	}
	gbps, err := parseIperf3(out)
	return gbps, cmd, err
}

// ucxPerftest runs `ucx_perftest -p PORT` and a tag_bw client over
// loopback as a user would (no -e: without peer error handling, which
// costs UCX 1.13 its shared-memory transports; if kvxfer's backend needs
// it, that cost is kvxfer's), with this process's UCX_* environment, the
// one the backend under test runs with (UCX_TLS included). Two message
// sizes: 16 MiB, and one message per request's bytes (at most 512 MiB), as
// the transceiver sends a pair's whole range at once; the best counts.
func (br *baselineRunner) ucxPerftest(ctx context.Context) Baseline {
	b := Baseline{Name: BaselineUCXPerftest, Description: "ucx_perftest tag_bw over loopback, best message size", Bytes: br.bytes}
	exe, err := br.lookPath("ucx_perftest")
	if err != nil {
		b.Skipped = "ucx_perftest is not installed (Debian package ucx-utils)"
		return b
	}
	b.Description += ucxTLSNote()
	sizes := []int64{min(br.bytes, 16<<20)}
	if whole := min(br.bytes, 512<<20); whole > sizes[0] {
		sizes = append(sizes, whole)
	}
	for _, msg := range sizes {
		// As many messages as make up the bytes (at least 8), after 2
		// warm-up messages (the default is 10000).
		iters := max(br.bytes/msg, 8)
		v := Variant{Setting: "-s " + humanBytes(msg)}
		port, err := freeport.Port()
		if err != nil {
			v.Error = err.Error()
			b.Variants = append(b.Variants, v)
			continue
		}
		p := strconv.Itoa(port)
		client := []string{exe, "127.0.0.1", "-p", p, "-t", "tag_bw", "-s", strconv.FormatInt(msg, 10),
			"-n", strconv.FormatInt(iters, 10), "-w", "2"}
		v.Command = "ucx_perftest " + strings.Join(client[1:], " ")
		out, err := br.serverClient(ctx, []string{exe, "-p", p}, client)
		if err == nil {
			v.GBps, err = parseUCXPerftest(out)
		}
		if err != nil {
			v.Error = firstLine(err.Error())
		}
		v.Bytes = msg * iters
		b.Variants = append(b.Variants, v)
	}
	b.pickBest()
	return b
}

// serverClient starts server, then runs client until it succeeds (the
// server may not listen yet) and returns the client's stdout (with an
// error, the last failed client's output, when there is one). The server
// is expected to exit after one client; it is killed if it does not.
func (br *baselineRunner) serverClient(ctx context.Context, server, client []string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, br.timeout)
	defer cancel()
	srv := exec.CommandContext(ctx, server[0], server[1:]...)
	var srvOut bytes.Buffer
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	if err := srv.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", strings.Join(server, " "), err)
	}
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Wait() }()
	defer waitOrKill(srv.Process, srvDone, 5*time.Second)
	var lastErr error
	var lastOut []byte
	retry := time.NewTicker(100 * time.Millisecond)
	defer retry.Stop()
	for attempt := 0; attempt < 30; attempt++ {
		cmd := exec.CommandContext(ctx, client[0], client[1:]...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		if err == nil && bytes.Contains(stdout.Bytes(), []byte("unable to connect to server")) {
			// iperf3 -J reports a refused connection (a server not yet
			// listening) in its JSON and may exit 0.
			err = errors.New("unable to connect to server")
		}
		if err == nil {
			return stdout.Bytes(), nil
		}
		lastErr, lastOut = err, append(stdout.Bytes(), stderr.Bytes()...)
		if ctx.Err() != nil || bytes.Contains(lastOut, []byte("parameter error")) {
			break // a refused setting does not get better by retrying
		}
		select {
		case <-ctx.Done():
		case <-retry.C:
		case err := <-srvDone:
			srvDone <- err // for the deferred wait
			return nil, fmt.Errorf("%s exited (%v) before a client ran: %s", server[0], err, tail(srvOut.Bytes()))
		}
	}
	srv.Process.Kill()
	return lastOut, fmt.Errorf("%s: %v: %s", strings.Join(client, " "), lastErr, tail(lastOut))
}

// toolLine returns the first line of out that starts with prefix (a
// tool's own error line, among its usage text), or "".
func toolLine(out []byte, prefix string) string {
	for line := range strings.Lines(string(out)) {
		if strings.HasPrefix(line, prefix) {
			return strings.TrimSpace(line)
		}
	}
	return ""
}

func tail(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 500 {
		s = "..." + s[len(s)-500:]
	}
	return s
}

// parseIperf3 reads the receiver's rate from `iperf3 -J` output.
func parseIperf3(out []byte) (float64, error) {
	var r struct {
		Error string `json:"error"`
		End   struct {
			SumReceived *struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
			SumSent *struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_sent"`
		} `json:"end"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		return 0, fmt.Errorf("iperf3 -J output: %w", err)
	}
	switch {
	case r.Error != "":
		return 0, fmt.Errorf("iperf3: %s", r.Error)
	case r.End.SumReceived != nil && r.End.SumReceived.BitsPerSecond > 0:
		return r.End.SumReceived.BitsPerSecond / 8 / 1e9, nil
	case r.End.SumSent != nil && r.End.SumSent.BitsPerSecond > 0:
		return r.End.SumSent.BitsPerSecond / 8 / 1e9, nil
	}
	return 0, errors.New("iperf3 -J output has no end.sum_received.bits_per_second")
}

// parseUCXPerftest reads the overall bandwidth of the final line of
// ucx_perftest's table: the last line of at least 8 numbers (after an
// optional label such as "Final:"), whose columns end with bandwidth
// average and overall in MB/s (2^20 bytes per second) and message rate
// average and overall.
func parseUCXPerftest(out []byte) (float64, error) {
	var last []float64
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) > 0 {
			if _, err := strconv.ParseFloat(f[0], 64); err != nil {
				f = f[1:] // "Final:", "[thread 0]" is two words but never the last line
			}
		}
		if len(f) < 8 {
			continue
		}
		nums := make([]float64, 0, len(f))
		for _, s := range f {
			v, err := strconv.ParseFloat(s, 64)
			if err != nil {
				nums = nil
				break
			}
			nums = append(nums, v)
		}
		if nums != nil {
			last = nums
		}
	}
	if last == nil {
		return 0, fmt.Errorf("ucx_perftest output has no result line: %s", tail(out))
	}
	mbps := last[len(last)-3]
	if mbps <= 0 {
		return 0, fmt.Errorf("ucx_perftest reported %v MB/s", mbps)
	}
	return mbps * (1 << 20) / 1e9, nil
}

// rawTCP times a plain TCP stream of n bytes from the peer process to this
// one over loopback, best of rounds.
func (p *peerProc) rawTCP(n int64, rounds int) (float64, error) {
	best := 0.0
	for range rounds {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		if err := p.send(peerMsg{Op: "rawtcp", Opaque: ln.Addr().String(), Bytes: n}); err != nil {
			ln.Close()
			return 0, err
		}
		ln.(*net.TCPListener).SetDeadline(time.Now().Add(30 * time.Second))
		c, err := ln.Accept()
		ln.Close()
		if err != nil {
			return 0, fmt.Errorf("bench: raw TCP baseline: %w", err)
		}
		buf := make([]byte, 4<<20)
		start := time.Now()
		got, err := io.CopyBuffer(io.Discard, readerOnly{c}, buf)
		d := time.Since(start)
		c.Close()
		if err != nil || got != n {
			return 0, fmt.Errorf("bench: raw TCP baseline: read %d of %d bytes: %v", got, n, err)
		}
		if m, err := p.read(); err != nil { // the peer's "sent"
			return 0, err
		} else if m.Error != "" {
			return 0, fmt.Errorf("bench: raw TCP baseline: context process: %s", m.Error)
		}
		best = max(best, float64(n)/d.Seconds()/1e9)
	}
	return best, nil
}

// readerOnly hides WriterTo/ReaderFrom so that io.CopyBuffer really copies
// through the user buffer, as a receiver writing into its own memory does.
type readerOnly struct{ r io.Reader }

func (r readerOnly) Read(b []byte) (int, error) { return r.r.Read(b) }

// sendRaw is the peer side of rawTCP.
func sendRaw(addr string, n int64) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, 4<<20)
	quickFill(buf, 1)
	for n > 0 {
		k := min(n, int64(len(buf)))
		if _, err := c.Write(buf[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// copyRounds is how many times each copy baseline is timed (the best
// counts), after a first copy that touches every page.
const copyRounds = 5

// copyBaseline measures a memory copy of n bytes (at most 1 GiB) on
// threads threads, each copying its share: with Go's copy and, where the
// binary has cgo, C's memcpy. The higher is the baseline. The shm backend's
// receiver copies on two goroutines, so it is compared with both the one-
// and the two-thread figure.
func copyBaseline(n int64, threads int) Baseline {
	n = min(n, 1<<30)
	b := Baseline{Name: BaselineCopy, Bytes: n,
		Description: fmt.Sprintf("memory copy in this process, one thread, best of %d after the pages are touched, Go copy and C memcpy", copyRounds)}
	if threads > 1 {
		b.Name = BaselineCopy2
		b.Description = fmt.Sprintf("memory copy in this process, %d threads each copying its share, best of %d after the pages are touched, Go copy and C memcpy", threads, copyRounds)
	}
	src, dst := make([]byte, n), make([]byte, n)
	quickFill(src, 2)
	for _, c := range []struct {
		setting string
		copy    func(dst, src []byte) error
	}{{"go copy", func(d, s []byte) error { copy(d, s); return nil }}, {"memcpy (cgo)", cMemcpy}} {
		v := Variant{Setting: c.setting}
		if err := copyOn(threads, dst, src, c.copy); err != nil {
			v.Error = err.Error()
		} else {
			for range copyRounds {
				start := time.Now()
				copyOn(threads, dst, src, c.copy)
				v.GBps = max(v.GBps, float64(n)/time.Since(start).Seconds()/1e9)
			}
		}
		b.Variants = append(b.Variants, v)
	}
	b.pickBest()
	return b
}

// copyOn copies src to dst with f on threads goroutines, each a contiguous
// share cut at a 4 KiB boundary.
func copyOn(threads int, dst, src []byte, f func(dst, src []byte) error) error {
	if threads <= 1 {
		return f(dst, src)
	}
	share := (len(src)/threads + 4095) &^ 4095
	var wg sync.WaitGroup
	errs := make([]error, threads)
	for i := range threads {
		lo := min(i*share, len(src))
		hi := min(lo+share, len(src))
		wg.Go(func() { errs[i] = f(dst[lo:hi], src[lo:hi]) })
	}
	wg.Wait()
	return errors.Join(errs...)
}
