//go:build ucx && cgo

package ucx

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
)

// localIfaces lists this machine's network interfaces and their addresses.
func localIfaces() ([]netIface, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	var out []netIface
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		ni := netIface{name: ifc.Name}
		for _, a := range addrs {
			if pn, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(pn.IP); ok {
					ni.addrs = append(ni.addrs, ip.Unmap())
				}
			}
		}
		out = append(out, ni)
	}
	return out, nil
}

// rdmaDevices lists the ports of this machine's RDMA devices as UCX names
// them ("mlx5_0:1"), from sysfs; none when there is no such device.
func rdmaDevices() []string {
	ports, _ := filepath.Glob("/sys/class/infiniband/*/ports/*")
	var out []string
	for _, p := range ports {
		dev := filepath.Base(filepath.Dir(filepath.Dir(p)))
		out = append(out, dev+":"+filepath.Base(p))
	}
	slices.Sort(out)
	return out
}

// resolveBinding is bindInterface on this machine when iface is set, else
// bindDevices.
func resolveBinding(ctx context.Context, listenAddr, iface string) (binding, error) {
	ifs, err := localIfaces()
	if err != nil {
		return binding{}, fmt.Errorf("list network interfaces: %w", err)
	}
	if iface != "" {
		return bindInterface(ctx, iface, ifs, rdmaDevices())
	}
	return bindDevices(ctx, listenAddr, ifs, rdmaDevices())
}

// envNetDevices returns UCX_NET_DEVICES when the environment sets it: then
// UCX uses the devices it names, and the backend leaves them alone.
func envNetDevices() (string, bool) { return os.LookupEnv("UCX_NET_DEVICES") }
