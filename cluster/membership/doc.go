// Package membership is the cluster's one etcd client: the cluster's
// format, the storage nodes and their epochs, the VDI table, and the
// VDI locks whose revisions are the fencing tokens. It can also run a
// single-member etcd inside the process (StartEmbedded) and compact an
// external one (StartCompactor).
//
// docs/membership.md gives the key layout byte by byte and the
// protocols; this comment is the contract.
//
// Files, by concern: client.go (Config, Connect, Close), keys.go (the
// key layout), embed.go (the embedded etcd), compact.go, format.go,
// epoch.go (views, the epoch rule, Watch), register.go (Join, the
// keepalive and fencing loop, the epoch bumper), vdi.go (the VDI
// table), altercopy.go (a VDI's copies per epoch), remove.go (nodes
// removed for good), recovered.go (recovery's per-node epochs), lock.go,
// evict.go, logging.go (etcd's zap logs into slog).
//
// Invariants:
//  1. Every change of the live node set produces one new epoch: epochs
//     are written by a txn guarded on the current epoch key's mod
//     revision, so of any number of racing writers one wins, and the
//     others re-read and find nothing to do. Changes that land before
//     any writer has read may share one epoch; no epoch is ever skipped
//     or written twice, and a written epoch is never overwritten.
//  2. An epoch lists the nodes whose keys were live at one revision,
//     sorted by ID. No epoch is written for an empty live set.
//  3. Every epoch is kept (epochs/ keys) until TrimEpochs removes it;
//     the current one is never trimmed.
//  4. A node key lives under its registration's lease. A second live
//     registration of one ID is refused (txn on create revision 0).
//  5. A registration is fenced (Fenced closes) no later than
//     fenceDeadline: TTL minus a margin after the send time of its last
//     successful renewal, on the client's clock, and at once when etcd
//     says its lease or its node key is gone. Once fenced it never
//     comes back: the node must stop serving and join again.
//  6. VDI ids come from a counter that only grows: an id is never
//     reused, even after its VDI is deleted. A deleted VDI leaves a
//     tombstone.
//  7. A VDI has at most one lock, under its holder's lease. Its token is
//     the lock key's create revision, so each new lock of any VDI has a
//     larger token than every earlier one. Storage nodes, not this
//     package, enforce the tokens: a client's belief that it holds a
//     lock can outlive the lock (see FIELD-NOTES on leases).
//  8. A VDI is not deleted while it is locked.
//  9. A change of a VDI's copies is written with a new epoch (same
//     nodes) in one txn, and the record keeps the earlier copies per
//     epoch: a record read once epoch E is known gives E's copies
//     (VDI.CopiesAt), and a request of E uses them.
//  10. A removed node ID (RemoveNode) never joins again, and has no
//     recovered/ or clean/ record; a registered node is not removed.
//
// Locking: Client.mu, then Registration.mu; neither is held across a
// call to etcd.
//
// Goroutines: Watch, StartCompactor and each Registration (two loops)
// start goroutines; Client.Close stops and waits for all of them, and
// Registration.Leave for its own.
//
// Order for callers: Connect (or StartEmbedded, then Connect to its
// Endpoints); Join; watch Fenced and stop serving when it closes; Lock
// the VDIs the node writes, under the Registration; Unlock; Leave;
// Close.
//
// Not done here: placement, the data path, recovery, and checking
// fencing tokens on writes (the store does that).
package membership
