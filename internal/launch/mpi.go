package launch

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/freeport"
	"github.com/kvxfer/kvxfer/serve"
)

// MPI: a cluster whose workers resolve to backend MPI is one MPI world.
// Start then launches every worker with a single mpirun, each world rank
// running `kvxfer serve-mpi` on a cluster file the launcher writes (with
// every instance's URL), and serve-mpi gives each rank its worker
// (AssignMPIRank). The router and the aggregated worker of up --smoke run
// outside the world, as always; the aggregated worker moves no KV cache
// and gets backend TCP.

// ErrMPIMixed: some server groups resolve to MPI and others do not; an MPI
// rank can move data only to ranks of its world.
var ErrMPIMixed = errors.New("launch: backend MPI must be every server group's backend")

// UsesMPI reports whether the cluster's workers resolve to backend MPI
// under env (explicit MPI, or DEFAULT with TRTLLM_USE_MPI_KVCACHE=1), and
// the reason logged for it; a cluster where only some groups do fails
// with ErrMPIMixed. A group without a transceiver block counts as DEFAULT,
// as Start gives it.
func UsesMPI(cl *config.Cluster, env config.Env) (bool, string, error) {
	var mpi, other []string
	reason := ""
	for _, g := range []struct {
		name string
		sg   *config.ServerGroup
	}{{"context_servers", &cl.Context}, {"generation_servers", &cl.Generation}} {
		b := config.BackendDefault
		if ct := g.sg.CacheTransceiver; ct != nil && ct.Backend != config.BackendUnset {
			b = ct.Backend
		}
		r := config.ResolveBackend(b, env, nil)
		if r.Backend == config.BackendMPI {
			mpi = append(mpi, g.name)
			reason = r.Reason
		} else {
			other = append(other, fmt.Sprintf("%s (%s)", g.name, r.Backend))
		}
	}
	if len(mpi) > 0 && len(other) > 0 {
		return false, "", fmt.Errorf("%w: %s resolve to MPI, %s do not", ErrMPIMixed, strings.Join(mpi, ", "), strings.Join(other, ", "))
	}
	return len(mpi) > 0, reason, nil
}

// MPIRank is what one rank of a cluster's MPI world runs.
type MPIRank struct {
	// Role is serve.RoleContext or serve.RoleGeneration.
	Role string
	// Index is the instance within its server group.
	Index int
	// SubRank is the rank within the instance (TensorRT-LLM's instance
	// sub-rank); 0 is the instance's leader, which runs the worker.
	SubRank int
	// Group is the instance's server group.
	Group *config.ServerGroup
}

// Name is the worker's name, as Start names workers ("context-0").
func (r MPIRank) Name() string { return fmt.Sprintf("%s-%d", r.Role, r.Index) }

// Leader reports whether the rank runs its instance's worker.
func (r MPIRank) Leader() bool { return r.SubRank == 0 }

// MPIWorldSizes returns the two world sizes a cluster runs on: one rank
// per instance (what Start launches: kvxfer runs an instance's TP×PP
// ranks in one process), and TensorRT-LLM's, TP×PP ranks per instance.
func MPIWorldSizes(cl *config.Cluster) (perInstance, upstream int) {
	for _, g := range []*config.ServerGroup{&cl.Context, &cl.Generation} {
		perInstance += g.NumInstances
		upstream += g.NumInstances * max(g.TensorParallelSize, 1) * max(g.PipelineParallelSize, 1)
	}
	return perInstance, upstream
}

// AssignMPIRank returns what world rank rank of a world of size runs, in
// TensorRT-LLM's order: the context instances, then the generation
// instances, each instance a contiguous block of ranks whose first is its
// leader. A block is one rank (size is MPIWorldSizes' perInstance) or the
// instance's TP×PP ranks (size is its upstream, as TensorRT-LLM's
// disaggregated MPI worker has it); there kvxfer's leader runs all of the
// instance's ranks and the others hold their place in the world.
func AssignMPIRank(cl *config.Cluster, rank, size int) (MPIRank, error) {
	perInstance, upstream := MPIWorldSizes(cl)
	if size != perInstance && size != upstream {
		return MPIRank{}, fmt.Errorf("launch: an MPI world of %d ranks for this cluster: want %d (one per instance) or %d (TP×PP per instance, as TensorRT-LLM)",
			size, perInstance, upstream)
	}
	if rank < 0 || rank >= size {
		return MPIRank{}, fmt.Errorf("launch: world rank %d outside a world of %d", rank, size)
	}
	off := 0
	for _, g := range []struct {
		role string
		sg   *config.ServerGroup
	}{{serve.RoleContext, &cl.Context}, {serve.RoleGeneration, &cl.Generation}} {
		block := 1
		if size == upstream && size != perInstance {
			block = max(g.sg.TensorParallelSize, 1) * max(g.sg.PipelineParallelSize, 1)
		}
		for i := range g.sg.NumInstances {
			if rank < off+block {
				return MPIRank{Role: g.role, Index: i, SubRank: rank - off, Group: g.sg}, nil
			}
			off += block
		}
	}
	return MPIRank{}, fmt.Errorf("launch: world rank %d not assigned (internal error)", rank)
}

// WorkerFile is the worker file of one instance of group g: what Start
// writes for the worker it starts, and kvxfer serve-mpi for its rank's.
func WorkerFile(cl *config.Cluster, g *config.ServerGroup) []byte {
	return workerYAML(g, &cl.Security, max(g.TensorParallelSize, 1), max(g.PipelineParallelSize, 1))
}

// mpiClusterYAML writes the cluster file the world's serve-mpi ranks read:
// the groups as Start gives them to its workers, with the URLs chosen.
func mpiClusterYAML(cl *config.Cluster, urls map[*config.ServerGroup][]string) []byte {
	var b bytes.Buffer
	for _, g := range []struct {
		key string
		sg  *config.ServerGroup
	}{{"context_servers", &cl.Context}, {"generation_servers", &cl.Generation}} {
		fmt.Fprintf(&b, "%s:\n  num_instances: %d\n  urls: %s\n", g.key, g.sg.NumInstances, yamlFlowList(urls[g.sg]))
		w := workerYAML(g.sg, &config.Security{}, max(g.sg.TensorParallelSize, 1), max(g.sg.PipelineParallelSize, 1))
		for _, line := range strings.SplitAfter(string(w), "\n") {
			if line != "" {
				b.WriteString("  " + line)
			}
		}
	}
	if hosts := cl.Security.AllowedPeerHosts; len(hosts) > 0 {
		fmt.Fprintf(&b, "security:\n  allowed_peer_hosts: %s\n", yamlFlowList(hosts))
	}
	return b.Bytes()
}

// MPIRootEnv are OpenMPI's own variables that let mpirun run as root; the
// launcher sets them only when it runs as root.
var MPIRootEnv = []string{"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"}

// mpirunArgs is mpirun's command line for a world of n ranks, each running
// command with args: --oversubscribe when this host has fewer cores than
// ranks, no binding (a Go process schedules its own threads), and every
// line of output tagged with its rank.
func mpirunArgs(n, cores int, command, args []string) []string {
	out := []string{"-np", fmt.Sprint(n), "--bind-to", "none", "--tag-output"}
	if cores < n {
		out = append(out, "--oversubscribe")
	}
	return append(append(out, command...), args...)
}

// startMPIWorkers starts every worker of the cluster as one MPI world:
// one mpirun whose ranks run serve-mpi on the cluster file it writes.
func (l *Launched) startMPIWorkers(o Options, reason string) error {
	if o.TLS.Enabled() || o.GenerateTLS {
		return errors.New("launch: backend MPI with TLS: not supported yet (MPI's data plane has no TLS; run without --tls, --tls-cert or security.tls)")
	}
	mpirun, err := exec.LookPath("mpirun")
	if err != nil {
		return fmt.Errorf("launch: backend MPI needs mpirun (Debian: apt-get install openmpi-bin; make deps installs it): %w", err)
	}
	cl := o.Cluster
	urls := map[*config.ServerGroup][]string{}
	type inst struct{ name, url string }
	var insts []inst
	for _, g := range []struct {
		role string
		sg   *config.ServerGroup
		urls *[]string
	}{{serve.RoleContext, &cl.Context, &l.ContextURLs}, {serve.RoleGeneration, &cl.Generation, &l.GenerationURL}} {
		for i := range g.sg.NumInstances {
			// mpirun does not hand inherited sockets on to its ranks,
			// so each rank binds its address itself.
			addr, err := mpiInstanceAddr(g.sg, i)
			if err != nil {
				return err
			}
			urls[g.sg] = append(urls[g.sg], addr)
			*g.urls = append(*g.urls, l.scheme+addr)
			insts = append(insts, inst{fmt.Sprintf("%s-%d", g.role, i), l.scheme + addr})
		}
	}
	path := filepath.Join(l.dir, "mpi_cluster.yaml")
	if err := os.WriteFile(path, mpiClusterYAML(cl, urls), 0o600); err != nil {
		return err
	}
	args := append(append([]string{}, o.Command[1:]...), "serve-mpi", "--config", path, "--model", o.Model)
	cmd := exec.Command(mpirun, mpirunArgs(len(insts), runtime.NumCPU(), o.Command[:1], args)...)
	cmd.Env = append(append(os.Environ(), o.Env...), config.EnvClusterSecret+"="+hex.EncodeToString(o.Secret))
	if os.Geteuid() == 0 {
		cmd.Env = append(cmd.Env, MPIRootEnv...)
	}
	p, err := l.startProc(cmd, "[mpi] ", o.Output)
	if err != nil {
		return fmt.Errorf("launch: start mpirun: %w", err)
	}
	// One process for every worker: each worker's entry is the world's
	// mpirun (Stop signals it, which forwards the signal to every rank).
	for _, in := range insts {
		l.workers = append(l.workers, &worker{name: in.name, url: in.url, p: p, world: true})
	}
	l.log.Info("workers started as one MPI world", "mpirun_pid", cmd.Process.Pid, "ranks", len(insts),
		"why", reason, "cluster_file", path)
	return nil
}

// workerEnv is the environment the workers see, as config reads it: this
// process's, with extra (Options.Env) winning.
func workerEnv(extra []string) config.Env {
	environ := append(os.Environ(), extra...)
	lookup := func(k string) (string, bool) {
		for i := len(extra) - 1; i >= 0; i-- {
			if name, v, ok := strings.Cut(extra[i], "="); ok && name == k {
				return v, true
			}
		}
		return os.LookupEnv(k)
	}
	return config.LoadEnv(lookup, environ)
}

// mpiInstanceAddr is the host:port of instance idx of a group under
// mpirun: its URL's, or a free loopback port below the ephemeral range
// (package freeport), which no port-0 bind on the host can take first.
func mpiInstanceAddr(g *config.ServerGroup, idx int) (string, error) {
	if idx < len(g.URLs) {
		return strings.TrimPrefix(strings.TrimPrefix(g.URLs[idx], "http://"), "https://"), nil
	}
	p, err := freeport.Port()
	if err != nil {
		return "", fmt.Errorf("launch: instance %d: %w", idx, err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p)), nil
}
