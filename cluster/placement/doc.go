// Package placement decides which nodes hold the replicas of each object.
//
// It is a pure function of the membership: a Map built by New from a
// node list (IDs, zones, weights) answers Place(id, copies) with the
// same node IDs on every machine, in every process, forever, for the
// same node list. It does no I/O, reads no clock and uses no randomness
// other than hashes of its inputs. It imports only the standard library
// and cluster/object.
//
// # Algorithm
//
// Weighted rendezvous hashing (HRW), per object, with failure domains.
// Every node i gets a score for object o: h = mix(hash(o) ^ seed(i)), a
// uniform 64-bit value, turned into the exponential variable
// -log2(h/2^64)/weight(i) when weights differ (the smaller wins). The
// node that wins is node i with probability weight(i)/Σweight, because
// the minimum of exponential variables is. When all weights are equal
// the raw h is compared, which orders nodes the same way, and no
// logarithm is taken. The logarithm is computed with integer arithmetic
// from a table built with integer arithmetic, so amd64 and arm64 (where
// the compiler fuses floating-point operations, and math.Log differs
// between assembly and Go) agree bit for bit.
//
// A zone's score is the best score of its nodes. Place returns the best
// node of each of the copies best zones, best first: the primary is the
// first element. Without zones (every node in zone 0) each node is its
// own failure domain and Place returns the copies best nodes.
//
// docs/placement.md compares this with Sheepdog's ring of 128 virtual
// nodes per node, with the simulation's numbers, and says why.
//
// # Invariants
//
//  1. Place is deterministic: it depends only on the set of nodes (ID,
//     zone, weight), the object ID and copies; never on the order the
//     nodes were given to New.
//  2. Place returns copies distinct nodes, and when zones are used,
//     copies distinct zones; it fails when copies > Zones().
//  3. A node's expected share of the primaries is its weight over the
//     total weight. Shares of all copies follow weights as long as no
//     node's weight is a large fraction of the total (sampling without
//     replacement: a node cannot hold two copies of one object).
//  4. Minimal movement. Adding a node changes an object's replica set
//     only by replacing one old node with the new one; nothing moves
//     between two old nodes. Removing a node changes only the objects
//     it held, by replacing it with one other node. This holds with and
//     without zones, because a node's score does not depend on the other
//     nodes. (Turning zones on, moving a node between zones or changing
//     its weight is a change of several nodes at once.)
//  5. A recovery planner tells which objects move between two maps with
//     Moved, which calls Place on both: an object moves if and only if
//     the two answers differ as sets. After a join, it moves only if the new
//     node is in its new set; after a leave, only if the old node was in
//     its old set.
//
// # Cost
//
// Place is O(nodes) with one multiply-xorshift hash per node and no
// allocation when dst has room: 0.3 µs for 100 nodes (0.65 µs with
// weights) and 1.5 µs for 1,000 on the machine of docs/placement.md.
// New is O(n log n): 80 µs for 1,000 nodes. A Map holds about 40 bytes
// per node besides the IDs.
//
// # Not done here
//
// Membership itself (who is up, epochs) belongs to cluster/membership;
// moving data belongs to recovery. A Map knows nothing of capacity used.
//
// Locking: a Map is immutable after New; there are no locks.
package placement
