// Package owner is who may write a VDI through this node, and with which
// fencing token: one ownership machine per VDI open here.
//
// The machine (Machine, Next) is pure: a state, the token, and why writes
// are refused, moved by events (the node's lease lost, the node back, the
// lock taken again or refused, the lock broken, a storage node refusing
// the token as stale, close). It does no I/O and reads no clock, so its
// every transition is listed in a table test. Authority drives it for the
// node and the gateway: it holds requests while the machine says so, and
// tells the gateway (cluster/gateway.Owner) the token to write with.
//
// The states (State):
//
//	ReadOnly   opened without the lock: reads only, for ever.
//	Live       holds the lock: writes carry Token.
//	Suspended  the node lost the lease the lock was held under; new
//	           requests wait.
//	Relocking  the node is back and is taking the lock again; requests
//	           still wait.
//	Lost       the lock went with the lease and could not be taken again
//	           (another owner took it), or the node closed first: writes
//	           fail with ErrLeaseLost, reads go on.
//	Revoked    another owner took the lock while this one held it (broken
//	           in etcd, or a storage node refused Token as stale): writes
//	           fail with ErrRevoked (EPERM), reads go on.
//	Closed     released: every request fails.
//
// Invariants:
//
//  1. Token changes only by Retaken, only in Relocking, and only upward
//     (membership.Relock gives a higher revision); writes carry the token
//     of a Live machine, or a token that the storage nodes refuse once a
//     newer owner fenced them.
//  2. Lost, Revoked and Closed are final but for Close: no event brings a
//     machine back to Live. Why, once set, keeps its first reason.
//  3. A stale-token refusal revokes only the token it was for: a refusal
//     of an older token (the node took the lock again meanwhile) changes
//     nothing, and the request goes again with the new one.
//  4. A machine that is not Live never admits a write; a Suspended or
//     Relocking one admits no request until it leaves those states.
//
// The next issue (moving VMs) adds the states of taking the lock on the
// first write, releasing it when the last writer leaves, and handing it
// over on request.
package owner
