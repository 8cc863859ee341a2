package launch

import (
	"errors"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/serve"
)

func loadCluster(t *testing.T, text string) *config.Cluster {
	t.Helper()
	f, err := config.LoadBytes("cluster.yaml", []byte(text), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	return f.Cluster
}

// naiveAssign is the reference: the list of every rank's (role, index,
// sub-rank), built by walking the instances.
func naiveAssign(cl *config.Cluster, upstream bool) [][3]any {
	var out [][3]any
	for _, g := range []struct {
		role string
		sg   *config.ServerGroup
	}{{serve.RoleContext, &cl.Context}, {serve.RoleGeneration, &cl.Generation}} {
		for i := 0; i < g.sg.NumInstances; i++ {
			n := 1
			if upstream {
				n = g.sg.TensorParallelSize * g.sg.PipelineParallelSize
			}
			for s := 0; s < n; s++ {
				out = append(out, [3]any{g.role, i, s})
			}
		}
	}
	return out
}

func TestAssignMPIRank(t *testing.T) {
	upstreamFile, err := os.ReadFile("../../config/testdata/upstream/cluster_mpi_worker_form.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for name, text := range map[string]string{
		"default":  string(DefaultCluster),
		"upstream": string(upstreamFile),
		"tp and pp": `
context_servers: {num_instances: 2, tensor_parallel_size: 2, pipeline_parallel_size: 2}
generation_servers: {num_instances: 3, tensor_parallel_size: 1}
`,
	} {
		cl := loadCluster(t, text)
		per, up := MPIWorldSizes(cl)
		for _, tc := range []struct {
			size     int
			upstream bool
		}{{per, false}, {up, true}} {
			want := naiveAssign(cl, tc.upstream)
			if len(want) != tc.size {
				t.Fatalf("%s: reference has %d ranks, world %d", name, len(want), tc.size)
			}
			for rank := range tc.size {
				r, err := AssignMPIRank(cl, rank, tc.size)
				if err != nil {
					t.Fatalf("%s: rank %d of %d: %v", name, rank, tc.size, err)
				}
				if got := [3]any{r.Role, r.Index, r.SubRank}; got != want[rank] {
					t.Errorf("%s: rank %d of %d = %v, want %v", name, rank, tc.size, got, want[rank])
				}
				if r.Leader() != (r.SubRank == 0) || !strings.HasPrefix(r.Name(), r.Role+"-") {
					t.Errorf("%s: rank %d: leader %v, name %q", name, rank, r.Leader(), r.Name())
				}
			}
		}
		for _, bad := range []int{0, per + 1, up + 1} {
			if bad == per || bad == up {
				continue
			}
			if _, err := AssignMPIRank(cl, 0, bad); err == nil {
				t.Errorf("%s: a world of %d ranks (want %d or %d) accepted", name, bad, per, up)
			}
		}
		if _, err := AssignMPIRank(cl, per, per); err == nil {
			t.Errorf("%s: rank %d of %d accepted", name, per, per)
		}
	}
}

func TestUsesMPI(t *testing.T) {
	group := func(b string) string {
		if b == "" {
			return "{num_instances: 1}"
		}
		return "{num_instances: 1, cache_transceiver_config: {backend: " + b + "}}"
	}
	useMPI := config.EnvFromMap(map[string]string{config.EnvUseMPI: "1"})
	for _, tc := range []struct {
		ctx, gen string
		env      config.Env
		want     bool
		mixed    bool
	}{
		{"MPI", "MPI", config.Env{}, true, false},
		{"TCP", "TCP", useMPI, false, false},
		{"DEFAULT", "DEFAULT", config.Env{}, false, false},
		{"DEFAULT", "DEFAULT", useMPI, true, false},
		{"", "", useMPI, true, false}, // no block: Start gives DEFAULT
		{"MPI", "TCP", config.Env{}, false, true},
		{"DEFAULT", "UCX", useMPI, false, true},
	} {
		cl := loadCluster(t, "context_servers: "+group(tc.ctx)+"\ngeneration_servers: "+group(tc.gen)+"\n")
		got, reason, err := UsesMPI(cl, tc.env)
		if tc.mixed {
			if !errors.Is(err, ErrMPIMixed) {
				t.Errorf("%s/%s: err %v, want ErrMPIMixed", tc.ctx, tc.gen, err)
			}
			continue
		}
		if err != nil || got != tc.want || (got && !strings.Contains(reason, "takes the whole world down")) {
			t.Errorf("%s/%s env %v: %v, %q, %v; want %v", tc.ctx, tc.gen, tc.env.Raw, got, reason, err, tc.want)
		}
	}
}

func TestMPIRunArgs(t *testing.T) {
	for _, tc := range []struct {
		n, cores int
		over     bool
	}{{2, 2, false}, {3, 2, true}, {2, 16, false}, {17, 16, true}} {
		args := mpirunArgs(tc.n, tc.cores, []string{"/bin/kvxfer"}, []string{"serve-mpi", "--config", "c.yaml"})
		if slices.Contains(args, "--oversubscribe") != tc.over {
			t.Errorf("%d ranks on %d cores: %q", tc.n, tc.cores, args)
		}
		if i := slices.Index(args, "-np"); i < 0 || args[i+1] != strconv.Itoa(tc.n) {
			t.Errorf("%d ranks: %q", tc.n, args)
		}
		if !slices.Contains(args, "none") || args[len(args)-4] != "/bin/kvxfer" || args[len(args)-1] != "c.yaml" {
			t.Errorf("%q: want --bind-to none and the command last", args)
		}
		for _, a := range args {
			if strings.Contains(a, "allow-run-as-root") {
				t.Errorf("%q: root is allowed only through OpenMPI's variables", args)
			}
		}
	}
}

// TestMPIClusterYAML: the cluster file the world's ranks read loads back
// with the groups Start gives its workers, and the URLs chosen.
func TestMPIClusterYAML(t *testing.T) {
	cl := loadCluster(t, `
context_servers:
  num_instances: 2
  tensor_parallel_size: 2
  kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
  cache_transceiver_config: {backend: MPI, kv_transfer_timeout_ms: 7000, max_tokens_in_buffer: 4096}
generation_servers:
  num_instances: 1
  pipeline_parallel_size: 2
  cache_transceiver_config: {backend: MPI}
security: {allowed_peer_hosts: [10.0.0.1]}
`)
	urls := map[*config.ServerGroup][]string{&cl.Context: {"127.0.0.1:9001", "127.0.0.1:9002"}, &cl.Generation: {"127.0.0.1:9003"}}
	got := loadCluster(t, string(mpiClusterYAML(cl, urls)))
	for _, g := range []struct{ got, want *config.ServerGroup }{{&got.Context, &cl.Context}, {&got.Generation, &cl.Generation}} {
		if g.got.NumInstances != g.want.NumInstances || g.got.TensorParallelSize != g.want.TensorParallelSize ||
			g.got.PipelineParallelSize != g.want.PipelineParallelSize || g.got.KVCache != g.want.KVCache ||
			!reflect.DeepEqual(g.got.URLs, urls[g.want]) {
			t.Errorf("group %+v, want %+v with urls %v", g.got, g.want, urls[g.want])
		}
		if g.got.CacheTransceiver.Backend != config.BackendMPI ||
			g.got.CacheTransceiver.KVTransferTimeoutMs != g.want.CacheTransceiver.KVTransferTimeoutMs ||
			g.got.CacheTransceiver.MaxTokensInBuffer != g.want.CacheTransceiver.MaxTokensInBuffer {
			t.Errorf("transceiver %+v, want %+v", g.got.CacheTransceiver, g.want.CacheTransceiver)
		}
	}
	if !slices.Equal(got.Security.AllowedPeerHosts, cl.Security.AllowedPeerHosts) {
		t.Errorf("allowed peer hosts %v, want %v", got.Security.AllowedPeerHosts, cl.Security.AllowedPeerHosts)
	}
}
