package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/serve"
)

// launchCluster starts a cluster whose workers are this test binary running the
// CLI (see TestMain).
func launchCluster(t *testing.T, clusterYAML string, aggregated bool) *launch.Launched {
	t.Helper()
	f, err := config.LoadBytes("cluster.yaml", []byte(clusterYAML), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	f.Cluster.Port = -1
	logs := &syncbuf.Buffer{}
	l, err := launch.Start(context.Background(), launch.Options{Cluster: f.Cluster, Aggregated: aggregated,
		Command: []string{os.Args[0]}, Env: []string{"KVXFER_CLI_CHILD=1"}, Output: logs, Ready: 60 * time.Second})
	if err != nil {
		t.Fatalf("launch: %v\n%s", err, logs.String())
	}
	t.Cleanup(func() {
		l.Stop()
		if t.Failed() {
			t.Logf("worker logs:\n%s", logs.String())
		}
	})
	return l
}

const smallCluster = `
context_servers:
  tensor_parallel_size: 2
  kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
  cache_transceiver_config: {backend: DEFAULT, kv_transfer_timeout_ms: 5000}
generation_servers:
  kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
  cache_transceiver_config: {backend: DEFAULT, kv_transfer_timeout_ms: 5000}
`

// TestUpSmoke is `kvxfer up --smoke` on the embedded default cluster: every
// answer through the router equals the aggregated worker's.
func TestUpSmoke(t *testing.T) {
	l := launchCluster(t, string(launch.DefaultCluster), true)
	res := launch.Smoke(context.Background(), l.RouterURL, l.AggregatedURL, 8, 4)
	if !res.OK() {
		t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
	}
}

// TestUpUpstreamShape: kvxfer up runs a cluster file in the README's shape,
// LLM options at the top level for both groups and no transceiver config
// (TensorRT-LLM's users start such workers with their own worker files):
// the launcher gives its workers backend DEFAULT, says so, and the answers
// equal the aggregated worker's.
func TestUpUpstreamShape(t *testing.T) {
	const text = `hostname: localhost
model: TinyLlama/TinyLlama-1.1B-Chat-v1.0
backend: pytorch
disable_overlap_scheduler: true
kv_cache_config: {tokens_per_block: 16, max_tokens: 8192, free_gpu_memory_fraction: 0.5}
context_servers:
  num_instances: 1
  tensor_parallel_size: 2
generation_servers:
  num_instances: 1
`
	f, err := config.LoadBytes("disagg_config.yaml", []byte(text), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	f.Cluster.Port = -1
	var logs syncbuf.Buffer
	l, err := launch.Start(context.Background(), launch.Options{Cluster: f.Cluster, Aggregated: true,
		Command: []string{os.Args[0]}, Env: []string{"KVXFER_CLI_CHILD=1"}, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatalf("launch: %v", err)
	}
	defer l.Stop()
	if n := strings.Count(logs.String(), "its workers get backend DEFAULT"); n != 2 {
		t.Errorf("said %d times that the groups get DEFAULT:\n%s", n, logs.String())
	}
	if res := launch.Smoke(context.Background(), l.RouterURL, l.AggregatedURL, 4, 2); !res.OK() {
		t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
	}
}

func freeBlocks(t *testing.T, url string) (int, int) {
	resp, err := http.Get(url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h struct {
		Free  int `json:"free_blocks"`
		Total int `json:"total_blocks"`
	}
	json.NewDecoder(resp.Body).Decode(&h)
	return h.Free, h.Total
}

// TestGenerationWorkerKilledMidStream: the client's stream ends with an
// error (no [DONE]) and the context worker's pool returns to its free count.
func TestGenerationWorkerKilledMidStream(t *testing.T) {
	l := launchCluster(t, smallCluster, false)
	body := `{"prompt":"a prompt for a long answer","max_tokens":3000,"ignore_eos":true,"stream":true}`
	resp, err := http.Post(l.RouterURL+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	chunks := 0
	for chunks < 5 && sc.Scan() {
		if strings.HasPrefix(sc.Text(), "data: ") {
			chunks++
		}
	}
	if chunks < 5 {
		t.Fatalf("stream ended after %d chunks", chunks)
	}
	syscall.Kill(l.Workers()["generation-0"], syscall.SIGKILL)
	done := make(chan bool, 1)
	go func() {
		sawDone := false
		for sc.Scan() {
			sawDone = sawDone || sc.Text() == "data: [DONE]"
		}
		done <- sawDone
	}()
	select {
	case sawDone := <-done:
		if sawDone {
			t.Fatal("the stream ended with [DONE] although its generation worker died")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the client's stream did not end after the generation worker died")
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		free, total := freeBlocks(t, l.ContextURLs[0])
		if free == total && total > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("context pool: %d of %d blocks free", free, total)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestGenerationWorkerKilledMigrates: with two generation workers, one
// SIGKILLed mid-stream hands its request over to the other (migration, on
// by default): the client's stream goes on to [DONE], and its token ids
// are the aggregated worker's, max_tokens of them.
func TestGenerationWorkerKilledMigrates(t *testing.T) {
	l := launchCluster(t, smallCluster+"  num_instances: 2\n", true)
	const maxTokens = 240
	body := map[string]any{"prompt": "a prompt for a long answer", "max_tokens": maxTokens, "ignore_eos": true, "temperature": 0.8, "seed": 9,
		"return_token_ids": true}
	b, _ := json.Marshal(body)
	start := time.Now()
	resp, err := http.Post(l.AggregatedURL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	var want struct {
		Choices []struct {
			TokenIDs []int32 `json:"token_ids"`
		} `json:"choices"`
	}
	json.NewDecoder(resp.Body).Decode(&want)
	resp.Body.Close()
	if len(want.Choices) != 1 || len(want.Choices[0].TokenIDs) != maxTokens {
		t.Fatalf("aggregated answer: %+v", want)
	}
	t.Logf("aggregated answer in %v", time.Since(start))
	start = time.Now()
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	b, _ = json.Marshal(body)
	resp, err = http.Post(l.RouterURL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	var ids []int32
	usage, done, chunks, killed := 0, false, 0, ""
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			break
		}
		var ev struct {
			Choices []struct {
				TokenIDs []int32 `json:"token_ids"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil || ev.Error != nil {
			t.Fatalf("event %s: %v", data, err)
		}
		for _, c := range ev.Choices {
			ids = append(ids, c.TokenIDs...)
		}
		if ev.Usage != nil {
			usage = ev.Usage.CompletionTokens
		}
		if chunks++; chunks == 5 {
			// Kill the generation worker that serves the stream.
			for i, u := range l.GenerationURL {
				r, err := http.Get(u + "/health")
				if err != nil {
					t.Fatal(err)
				}
				var h struct {
					Running int `json:"running"`
				}
				json.NewDecoder(r.Body).Decode(&h)
				r.Body.Close()
				if h.Running > 0 {
					killed = fmt.Sprint("generation-", i)
					syscall.Kill(l.Workers()[killed], syscall.SIGKILL)
					break
				}
			}
			if killed == "" {
				t.Fatal("no generation worker is running the request")
			}
			t.Logf("%s killed after %v", killed, time.Since(start))
		}
	}
	t.Logf("stream done after %v", time.Since(start))
	if !done || len(ids) != maxTokens || usage != maxTokens || !slices.Equal(ids, want.Choices[0].TokenIDs) {
		t.Fatalf("after %s was killed: [DONE] %v, %d token ids (usage %d), equal to the aggregated worker's: %v; want %d",
			killed, done, len(ids), usage, slices.Equal(ids, want.Choices[0].TokenIDs), maxTokens)
	}
}

// TestContextWorkerKilledBeforePull: the generation request fails within
// the transfer timeout with an error that says what happened.
func TestContextWorkerKilledBeforePull(t *testing.T) {
	l := launchCluster(t, smallCluster, false)
	post := func(url, body string) (int, string) {
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, raw := post(l.ContextURLs[0], `{"prompt":"hello","max_tokens":8,"disaggregated_params":{"request_type":"context_only"}}`)
	if code != 200 {
		t.Fatalf("context: %d %s", code, raw)
	}
	var c struct {
		Choices []struct {
			Disagg serve.DisaggregatedParams `json:"disaggregated_params"`
		} `json:"choices"`
		Prompt []int32 `json:"prompt_token_ids"`
	}
	json.Unmarshal([]byte(raw), &c)
	pid := l.Workers()["context-0"]
	syscall.Kill(pid, syscall.SIGKILL)
	waitDead(t, pid)
	dp := c.Choices[0].Disagg
	dp.RequestType = serve.TypeGenerationOnly
	b, _ := json.Marshal(map[string]any{"prompt": c.Prompt, "max_tokens": 8, "disaggregated_params": dp})
	start := time.Now()
	code, raw = post(l.GenerationURL[0], string(b))
	if code == 200 {
		t.Fatalf("generation succeeded without its context worker: %s", raw)
	}
	if d := time.Since(start); d > 6*time.Second {
		t.Errorf("failed after %v; the transfer timeout is 5s", d)
	}
	if !strings.Contains(raw, "kv_transfer") || !strings.Contains(raw, "context rank") {
		t.Errorf("unclear error %d %s", code, raw)
	}
}

// waitDead waits until process pid, SIGKILLed, has died (gone, a zombie,
// or its pid another process's): kill returns before the process stops
// running, and a loaded machine can leave it running long enough to
// answer (a SIGSTOPped process served a whole transfer after kill
// returned: python/tests' test_sync_timeout).
func waitDead(t *testing.T, pid int) {
	t.Helper()
	// stat returns the fields after the command name: the state first,
	// the start time 20th.
	stat := func() []string {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if i := bytes.LastIndexByte(b, ')'); err == nil && i >= 0 {
			if f := strings.Fields(string(b[i+1:])); len(f) >= 20 {
				return f
			}
		}
		return nil
	}
	first := stat()
	deadline := time.Now().Add(10 * time.Second)
	for {
		f := stat()
		if first == nil || f == nil || f[0] == "Z" || f[19] != first[19] {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d still not dead 10 s after it was told to end (state %s)", pid, f[0])
		}
		time.Sleep(time.Millisecond)
	}
}

// TestOpenAINodeClient: the openai npm package, run by the machine's
// Node.js, completes a prompt through the router, streaming and not.
func TestOpenAINodeClient(t *testing.T) {
	dir, _ := filepath.Abs(filepath.Join("..", "..", "tests", "node"))
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "openai")); err != nil {
		if os.Getenv("KVXFER_REQUIRE_NODE") == "1" {
			t.Fatalf("openai npm package missing in %s (make test installs it): %v", dir, err)
		}
		t.Skipf("openai npm package not installed in %s (make test installs it)", dir)
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node not found")
	}
	l := launchCluster(t, smallCluster, false)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, node, filepath.Join(dir, "client.mjs"), l.RouterURL+"/v1").CombinedOutput()
	if err != nil {
		t.Fatalf("node client: %v\n%s", err, out)
	}
	for _, want := range []string{"completion ok", "stream ok", "chat ok"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("node client output lacks %q:\n%s", want, out)
		}
	}
}

// upProc is a kvxfer up run as its own process (this test binary, as are
// its workers), with its output.
type upProc struct {
	cmd  *exec.Cmd
	out  *syncbuf.Buffer
	done chan struct{}
}

// startUp runs kvxfer up with args, on a free router port, and waits (at
// most 60 s) until it has printed the PIDs of its workers, which it
// returns by name.
func startUp(t *testing.T, args ...string) (*upProc, map[string]int) {
	t.Helper()
	p := &upProc{out: &syncbuf.Buffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(os.Args[0], append([]string{"up", "--quiet", "--port", "-1"}, args...)...)
	// Its own TMPDIR: a kvxfer up killed leaves its directory of worker
	// files behind.
	p.cmd.Env = append(os.Environ(), "KVXFER_CLI_CHILD=1", "TMPDIR="+t.TempDir())
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			t.Logf("kvxfer up's output:\n%s", p.out.String())
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for {
		pids := map[string]int{}
		for _, line := range strings.Split(p.out.String(), "\n") {
			var name string
			var pid int
			if _, err := fmt.Sscanf(strings.TrimSpace(line), "worker %s pid %d", &name, &pid); err == nil {
				pids[name] = pid
			}
		}
		if strings.Contains(p.out.String(), "router:") && len(pids) > 0 {
			return p, pids
		}
		select {
		case <-p.done:
			t.Fatalf("kvxfer up exited at start-up: %v", p.cmd.ProcessState)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("kvxfer up did not start its cluster within 60 s")
		}
	}
}

// TestUpEndsWhenGroupLost: kvxfer up whose only generation worker dies
// does not go on serving 502s until Ctrl-C (and then exit 0): it stops
// the context worker and exits non-zero, naming the worker that died.
func TestUpEndsWhenGroupLost(t *testing.T) {
	p, pids := startUp(t)
	if pids["generation-0"] == 0 || pids["context-0"] == 0 {
		t.Fatalf("workers %v, want context-0 and generation-0", pids)
	}
	syscall.Kill(pids["generation-0"], syscall.SIGKILL)
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		t.Fatal("kvxfer up still runs 20 s after its only generation worker died")
	}
	if code := p.cmd.ProcessState.ExitCode(); code == 0 {
		t.Errorf("kvxfer up exited 0 after its only generation worker died")
	}
	for _, want := range []string{"generation_servers has no worker left", "generation-0", "signal: killed"} {
		if !strings.Contains(p.out.String(), want) {
			t.Errorf("kvxfer up's output does not say %q", want)
		}
	}
	waitDead(t, pids["context-0"])
}

// fakeStopper is a cluster whose Stop waits until Kill (at most 10 s).
type fakeStopper struct {
	killed chan struct{}
	once   sync.Once
}

func (f *fakeStopper) Stop() {
	select {
	case <-f.killed:
	case <-time.After(10 * time.Second):
	}
}

func (f *fakeStopper) Kill() { f.once.Do(func() { close(f.killed) }) }

// TestStopClusterSecondSignal: kvxfer up stopped by a signal kills its
// workers at the next one instead of waiting out their grace; one stopped
// otherwise (a group lost) kills them at the first.
func TestStopClusterSecondSignal(t *testing.T) {
	for _, need := range []int{1, 2} {
		f := &fakeStopper{killed: make(chan struct{})}
		sigs := make(chan os.Signal, 2)
		if need == 2 {
			sigs <- syscall.SIGINT // the one that ended the command's context
		}
		var out bytes.Buffer
		done := make(chan struct{})
		go func() {
			stopCluster(f, sigs, need, &out)
			close(done)
		}()
		select {
		case <-done:
			t.Fatalf("need %d: stopCluster returned before its cluster stopped", need)
		case <-time.After(200 * time.Millisecond):
		}
		start := time.Now()
		sigs <- syscall.SIGTERM
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("need %d: stopCluster still waits 5 s after the signal", need)
		}
		if !strings.Contains(out.String(), "terminated while stopping: killing every worker now") {
			t.Errorf("need %d: output %q", need, out.String())
		}
		t.Logf("need %d: stopped %v after the signal", need, time.Since(start).Round(time.Millisecond))
	}
}

// TestUpKilledWorkersEnd: kvxfer up killed with SIGKILL (no chance to stop
// anything: the OOM killer, kill -9, a container's end) leaves no worker
// running: each has the launcher's death as its SIGTERM (Pdeathsig).
func TestUpKilledWorkersEnd(t *testing.T) {
	p, pids := startUp(t)
	if len(pids) != 2 {
		t.Fatalf("workers %v, want context-0 and generation-0", pids)
	}
	p.cmd.Process.Kill()
	<-p.done
	for _, pid := range pids {
		waitDead(t, pid)
	}
}
