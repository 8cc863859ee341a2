package buildinfo

import (
	"runtime"
	"runtime/debug"
)

// Set at link time by the Makefile; empty otherwise.
var (
	Version  string
	Revision string
)

// Info describes the running binary.
type Info struct {
	Module    string `json:"module"`
	Version   string `json:"version"`
	Revision  string `json:"revision"`
	Modified  bool   `json:"modified"`
	GoVersion string `json:"go_version"`
	Platform  string `json:"platform"`
	Tags      string `json:"tags,omitempty"`
}

// Read returns the binary's build information.
func Read() Info {
	in := Info{Module: "github.com/kvxfer/kvxfer", Version: "(devel)", Revision: "unknown",
		GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if bi.Main.Path != "" {
			in.Module = bi.Main.Path
		}
		if bi.Main.Version != "" {
			in.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				in.Revision = s.Value
			case "vcs.modified":
				in.Modified = s.Value == "true"
			case "-tags":
				in.Tags = s.Value
			}
		}
	}
	if Version != "" {
		in.Version = Version
	}
	if Revision != "" {
		in.Revision = Revision
	}
	return in
}
