// Package serve runs one image as an NBD export: the logic behind
// `ovis nbd` (a drop-in for qemu-nbd 7.2) and `ovis up`.
//
// Files, by concern: config.go (Config, Validate and the qemu-nbd option
// values), device.go (opening the image under a cache mode, the -s
// overlay), policy.go (the --discard and --detect-zeroes device wrapper),
// listener.go (binding, the -e connection limit, noticing the last
// client through the nbd server's ConnState hook), tls.go and
// tlsobject.go, daemon.go
// (--fork and --pid-file), run.go (Run: the lifecycle), list.go (List:
// qemu-nbd --list, the client side) and up.go (Up).
//
// Run's order, which callers rely on:
//
//  1. Validate the Config, open the image (and the -s overlay) under the
//     cache mode, bind the listener, write the pid file, then call
//     Config.Ready: from then on clients can connect.
//  2. Serve until the context ends (SIGINT, SIGTERM), the listener fails,
//     or — without Persistent — the last client that completed a
//     handshake disconnects.
//  3. Stop: stop accepting, let requests in service finish and reply
//     (nbd.Server.Shutdown, bounded by ShutdownTimeout), flush (bounded
//     by ShutdownTimeout again) and close the device, then remove the
//     socket file, the pid file and the overlay. The first error is
//     returned, but the teardown finishes.
//
// Invariants:
//
//  1. The device is closed after the server has stopped calling it, and
//     exactly once.
//  2. At most Config.Shared connections are open at once (0: no limit);
//     further clients wait in the listen backlog, as with qemu-nbd.
//  3. CAN_MULTI_CONN is advertised exactly when more than one connection
//     is allowed (Shared != 1), as qemu-nbd 7.2 does. That is always sound
//     for ovis devices: every connection shares one block.Device, whose
//     Flush and FUA writes cover the writes made through all of them.
//
// Differences from qemu-nbd: TLS takes PEM files (--tls-cert,
// --tls-key, --tls-ca) instead of --object tls-creds-x509; only a socket
// file is removed from the -k path before binding (qemu-nbd removes any
// file); --idle-timeout (none by default) closes idle connections, which
// qemu-nbd cannot; the -s overlay is unlinked as soon as it is open; the
// qcow2 cache options are flags as well as --image-opts. Image files are
// locked as qemu-nbd locks them (block.Perm), the export refusing others
// the right to resize it.
//
// Output: like qemu-nbd, a normal run prints nothing on stderr (-v adds
// nothing for a server); ovis's own logs go to Config.Logger (ovis nbd
// --log-level, warnings by default), qemu-nbd's warnings to
// Config.Warnings in its words. A raw image is exported in whole 512-byte
// sectors, as QEMU sizes it (block.Raw.RoundUpToSector).
//
// TLS is also configured as qemu-nbd does, by --object tls-creds-x509
// and --tls-creds (tlsobject.go), for serving and for List.
//
// Not done here: --object types other than tls-creds-x509 (secrets,
// authz), --tls-authz, -o/--offset, -c/-d (the kernel client), --aio,
// --selinux-label and socket activation.
package serve
