// Package export is what stands between an NBD server and a block.Device:
// the options qemu-nbd applies above the format driver, and the counters
// of what the clients asked.
//
//   - WithCacheMode gives a device the write semantics of a QEMU cache
//     mode (writethrough makes every write FUA; unsafe drops flushes and
//     FUA).
//   - WithPolicy applies --discard and --detect-zeroes as QEMU's block
//     layer does.
//   - Metrics.Wrap counts requests, bytes, errors and latency by
//     operation for Prometheus.
//
// Each is a block.Device wrapping a block.Device, so `ovis nbd`, `ovis
// up`, `ovis img` and the cluster's gateways (cluster/node) stack the
// same layers. None of them holds a lock across the wrapped device's I/O.
package export
