package ucx

// Which network devices UCX may use, from the listen address (pure Go,
// without the build tag, so that it is tested in every build).

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
)

// binding is what UCX is told to listen on: the network devices that
// hold the configured host, or every device.
type binding struct {
	host    netip.Addr // the configured address; invalid: every device
	devices []string   // UCX_NET_DEVICES; nil: every device (UCX's default)
	ipv6    bool       // the host is IPv6: prefer UCX's tcp over inet6
}

// String names the binding in logs and in Listeners.
func (b binding) String() string {
	if !b.host.IsValid() {
		return "every device"
	}
	return b.host.String() + " (" + strings.Join(b.devices, ",") + ")"
}

// netIface is what bindDevices needs of a network interface.
type netIface struct {
	name  string
	addrs []netip.Addr
}

// bindDevices chooses UCX's network devices for listenAddr (host:port; the
// port does not apply). UCX's tcp transport listens on the address of every
// network device it uses, whatever the caller asked, so the devices are
// restricted to those that hold the host: an unspecified host (0.0.0.0,
// ::, "") leaves every device; a loopback host gives the loopback devices
// only (shared memory still works, and nothing is reachable from another
// machine); any other host gives the devices holding it plus the RDMA
// devices (rdma, "mlx5_0:1"), which have no listening socket. A host that is
// no interface's address is an error: UCX cannot bind it.
func bindDevices(ctx context.Context, listenAddr string, ifaces []netIface, rdma []string) (binding, error) {
	host, _, err := net.SplitHostPort(listenAddr)
	if err != nil {
		return binding{}, fmt.Errorf("listen address %q: %w", listenAddr, err)
	}
	var ips []netip.Addr
	if host == "" {
		return binding{}, nil
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		ips = []netip.Addr{ip.WithZone("")}
	} else if ips, err = net.DefaultResolver.LookupNetIP(ctx, "ip", host); err != nil {
		return binding{}, fmt.Errorf("listen host %q: %w", host, err)
	}
	var b binding
	loopback := true
	for _, ip := range ips {
		ip = ip.Unmap()
		if ip.IsUnspecified() {
			return binding{}, nil
		}
		if !b.host.IsValid() {
			b.host, b.ipv6 = ip, ip.Is6()
		}
		loopback = loopback && ip.IsLoopback()
		for _, ifc := range ifaces {
			if slices.Contains(ifc.addrs, ip) && !slices.Contains(b.devices, ifc.name) {
				b.devices = append(b.devices, ifc.name)
			}
		}
	}
	if len(b.devices) == 0 {
		return binding{}, fmt.Errorf("listen host %s is not the address of any network interface of this machine (UCX listens on whole devices)", host)
	}
	if !loopback {
		b.devices = append(b.devices, rdma...)
	}
	return b, nil
}
