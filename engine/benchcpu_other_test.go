//go:build !unix

package engine

import "time"

// processCPU is not measured here: the benchmarks report no CPU figures.
func processCPU() time.Duration { return 0 }
