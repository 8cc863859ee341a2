package cli

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// mpiWorld is the MPI world of this binary (package transport/mpi's Init,
// World, Finalize), set by mpi.go in builds with -tags mpi; nil without.
var mpiWorld *mpiFuncs

type mpiFuncs struct {
	init     func(*slog.Logger) error
	world    func() (rank, size int, ok bool)
	finalize func() error
	abort    func(code int)
}

// serveMPIFlags are kvxfer serve-mpi's flags.
type serveMPIFlags struct {
	cluster, model, dtype, txHost string
	lf                            logFlags
	admin                         adminFlag
	hf                            httpFlags
}

func newServeMPICmd(e env) *cobra.Command {
	var mf serveMPIFlags
	cmd := &cobra.Command{
		Use:   "serve-mpi -c disagg_config.yaml",
		Short: "Run this MPI rank's worker of a cluster launched as one MPI world (backend MPI)",
		Long: `serve-mpi is what every rank of a cluster's MPI world runs (mpirun -np N kvxfer serve-mpi -c FILE;
kvxfer up does it for a cluster whose backend resolves to MPI). Each world rank takes its worker from
the cluster file in TensorRT-LLM's order: the context instances, then the generation instances. With N
equal to the number of instances each rank runs one worker; with N equal to the sum of TP x PP over the
instances (TensorRT-LLM's disaggregated MPI worker), an instance's first rank runs its worker (kvxfer
runs an instance's TP x PP ranks in one process) and the others hold their place in the world. Every
instance needs a URL in the file. The router runs outside the world (kvxfer router -c FILE).
A rank that dies takes the whole MPI world down.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runServeMPI(cmd, e, &mf) },
	}
	f := cmd.Flags()
	f.StringVarP(&mf.cluster, "config", "c", "", "cluster file (TensorRT-LLM's disagg_config.yaml), with urls for every instance")
	f.StringVar(&mf.model, "model", serve.DefaultModel, "model preset: tiny-gqa, tiny-gqa2, tiny-mla")
	f.StringVar(&mf.dtype, "dtype", "bf16", "KV cache dtype: fp32, fp16, bf16, fp8")
	f.StringVar(&mf.txHost, "transceiver-host", "127.0.0.1", "address the transceiver's control listener binds to")
	mf.lf.add(cmd)
	mf.admin.add(cmd)
	mf.hf.add(cmd)
	cmd.MarkFlagRequired("config")
	return cmd
}

// runServeMPI initialises the MPI world, finds this rank's worker and
// serves it (as kvxfer serve would) until the command's context ends.
func runServeMPI(cmd *cobra.Command, e env, mf *serveMPIFlags) error {
	log, err := mf.lf.logger(cmd)
	if err != nil {
		return err
	}
	if mpiWorld == nil {
		return fmt.Errorf("serve-mpi: the MPI backend is not built in this binary: build with -tags mpi (needs libopenmpi-dev)")
	}
	cl, err := loadCluster(mf.cluster, e, log)
	if err != nil {
		return err
	}
	// Init first, on every rank: it is collective, and a rank that
	// returns before it would leave the others waiting.
	if err := mpiWorld.init(log); err != nil {
		return fmt.Errorf("serve-mpi: %w", err)
	}
	defer func() {
		if err := mpiWorld.finalize(); err != nil {
			log.Error("serve-mpi: finalize", "err", err)
		}
	}()
	rank, size, _ := mpiWorld.world()
	err = serveRank(cmd, e, mf, cl, rank, size, log)
	if err != nil && cmd.Context().Err() == nil {
		// The other ranks would wait for this one (in MPI_Finalize, or
		// for its data): take the world down, as a dead rank does.
		log.Error("serve-mpi: this rank cannot go on; aborting the MPI world", "world_rank", rank, "err", err)
		mpiWorld.abort(1)
	}
	return err
}

// serveRank runs what world rank rank of size runs: its worker, or, for
// an instance's rank other than the first, nothing until ctx ends.
func serveRank(cmd *cobra.Command, e env, mf *serveMPIFlags, cl *config.Cluster, rank, size int, log *slog.Logger) error {
	r, err := launch.AssignMPIRank(cl, rank, size)
	if err != nil {
		return fmt.Errorf("serve-mpi: %w", err)
	}
	log = log.With("world_rank", rank, "worker", r.Name())
	if !r.Leader() {
		log.Info("serve-mpi: this rank holds its place in the world; its instance's leader runs all of the instance's ranks",
			"sub_rank", r.SubRank)
		<-cmd.Context().Done()
		return nil
	}
	if r.Index >= len(r.Group.URLs) {
		return fmt.Errorf("serve-mpi: %s has no URL in %s: serve-mpi needs urls for every instance", r.Name(), mf.cluster)
	}
	host, port, err := net.SplitHostPort(r.Group.URLs[r.Index])
	if err != nil {
		return fmt.Errorf("serve-mpi: %s: url %q: %w", r.Name(), r.Group.URLs[r.Index], err)
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return fmt.Errorf("serve-mpi: %s: url %q: port: %w", r.Name(), r.Group.URLs[r.Index], err)
	}
	dir, err := os.MkdirTemp("", "kvxfer-serve-mpi-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	wf := filepath.Join(dir, r.Name()+".yaml")
	if err := os.WriteFile(wf, launch.WorkerFile(cl, r.Group), 0o600); err != nil {
		return err
	}
	log.Info("serve-mpi: this rank runs its worker", "role", r.Role, "url", r.Group.URLs[r.Index], "world_size", size,
		"note", config.MPIWorldNote)
	// Removed as soon as it is read: mpirun ends its ranks with signals
	// that may not leave them time to run the deferred removal.
	sf := &serveFlags{role: r.Role, cfgPath: wf, model: mf.model, host: host, port: p, dtype: mf.dtype, txHost: mf.txHost,
		lf: mf.lf, admin: mf.admin, hf: mf.hf, cfgRead: func() { os.RemoveAll(dir) }}
	return runServe(cmd, e, sf)
}
