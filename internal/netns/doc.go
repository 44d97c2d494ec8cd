// Package netns builds a small network of Linux network namespaces for
// tests and benches that need partitions between real processes.
//
// A Net is one bridge in the root namespace, with the address
// 10.A.B.1/24 (HostAddr), and N namespaces, each joined to the bridge
// by a veth pair, with the address 10.A.B.(10+i)/24 (Addr) on its eth0
// and its loopback up. A and B are chosen at random among the /24s the
// root namespace has no address or route in. Processes started with Cmd
// run inside namespace i (through `ip netns exec`, which execs the
// program, so the *exec.Cmd's process is the program itself); a process
// in the root namespace (an etcd, a checker) reaches them at Addr(i),
// and they reach it at HostAddr. Every namespace has its own port space:
// every node of a cluster can listen on the same port.
//
// Cut(i) sets the host side of namespace i's veth down: from then on no
// packet leaves or enters namespace i, for new connections and for
// established ones alike (TCP retransmits into the void, a dial times
// out or fails with "no route to host"). Heal(i) sets it up again, and
// established connections that have not timed out carry on: a
// partition, not a crash. The test of this package shows both on real
// sockets, from the root namespace and from another namespace.
//
// Order for callers:
//
//  1. New (or NewT in a test) with the number of namespaces;
//  2. Cmd(i, …) to start processes, Addr(i) and HostAddr for addresses;
//  3. Cut(i) and Heal(i) at will, from any goroutine;
//  4. stop the processes, then Close. Close deletes the namespaces, the
//     veth pairs and the bridge; a process still running in a deleted
//     namespace keeps its namespace but has no network left.
//
// Names: every link and namespace is named ovnPPPPPPSS… (P the creating
// process's ID in hex, S a per-process sequence number), so concurrent
// Nets of one or of several processes never clash, and New deletes
// leftovers of processes that no longer exist (a crashed run).
//
// Not done here: delay, loss or one-way cuts (the kernels these run on
// have no netem; put a proxy in the path for delay), routing between
// Nets, IPv6. It needs root (CAP_NET_ADMIN) and iproute2's ip.
package netns
