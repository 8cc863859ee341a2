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

// bindInterface chooses UCX's binding for the network interface name
// (Options.Interface): the listen host is the interface's first IPv4
// address, or its first address when it has no IPv4 one (UCX's tcp binds a
// device's IPv4 address when it has one), and the devices are bindDevices'
// for that host. An interface that is not in ifaces is an error naming
// those that are.
func bindInterface(ctx context.Context, name string, ifaces []netIface, rdma []string) (binding, error) {
	i := slices.IndexFunc(ifaces, func(f netIface) bool { return f.name == name })
	if i < 0 {
		names := make([]string, len(ifaces))
		for j, f := range ifaces {
			names[j] = f.name
		}
		return binding{}, fmt.Errorf("no network interface %q on this host (it has: %s)", name, strings.Join(names, ", "))
	}
	addrs := ifaces[i].addrs
	if len(addrs) == 0 {
		return binding{}, fmt.Errorf("network interface %q has no IP address", name)
	}
	host := addrs[0]
	if v4 := slices.IndexFunc(addrs, netip.Addr.Is4); v4 >= 0 {
		host = addrs[v4]
	}
	b, err := bindDevices(ctx, netip.AddrPortFrom(host, 0).String(), ifaces, rdma)
	if err != nil {
		return binding{}, fmt.Errorf("network interface %q: %w", name, err)
	}
	return b, nil
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
