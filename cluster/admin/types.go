package admin

import (
	"fmt"
	"strings"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
)

// None is the request of a verb that takes no arguments.
type None struct{}

// Ack is the reply of a verb that only says it was done ("kicked",
// "recovered", …).
type Ack string

// MaxData bounds the bytes one vdi.read or vdi.write carries.
const MaxData = 4 << 20

// FormatRequest formats the cluster (verb format). Copies 0 is the
// default of membership.FormatFor; ObjectShift 0 the default object size.
type FormatRequest struct {
	Copies      int   `json:"copies,omitempty"`
	ObjectShift uint8 `json:"object_shift,omitempty"`
	Force       bool  `json:"force,omitempty"`
	Strict      bool  `json:"strict,omitempty"`
}

// NameRequest names a VDI or a node (vdi.allocated, vdi.delete,
// lock.break, node.remove).
type NameRequest struct {
	Name string `json:"name,omitempty"`
}

// NodeRemoved is node.remove's reply.
type NodeRemoved struct {
	Removed string `json:"removed"`
}

// VDICreateRequest creates a VDI (vdi.create); Copies and ObjectShift 0
// take the format's (membership.NewVDI).
type VDICreateRequest struct {
	Name        string `json:"name,omitempty"`
	Size        int64  `json:"size,omitempty"`
	Copies      int    `json:"copies,omitempty"`
	ObjectShift uint8  `json:"object_shift,omitempty"`
}

// VDIResizeRequest changes a VDI's size (vdi.resize); a smaller size
// needs Shrink.
type VDIResizeRequest struct {
	Name   string `json:"name,omitempty"`
	Size   int64  `json:"size,omitempty"`
	Shrink bool   `json:"shrink,omitempty"`
}

// VDIAlterCopyRequest changes a VDI's copies (vdi.alter-copy).
type VDIAlterCopyRequest struct {
	Name   string `json:"name,omitempty"`
	Copies int    `json:"copies,omitempty"`
}

// VDIReadRequest reads at most MaxData bytes of a VDI (vdi.read).
type VDIReadRequest struct {
	Name   string `json:"name,omitempty"`
	Offset int64  `json:"offset,omitempty"`
	Length int64  `json:"length,omitempty"`
}

// VDIReadReply is vdi.read's reply: the VDI's size, and the bytes read
// (fewer than asked at the VDI's end, none past it), carried raw after
// the JSON.
type VDIReadReply struct {
	Size int64  `json:"size"`
	Data []byte `json:"-"`
}

// VDIWriteRequest writes Data at Offset of a VDI and flushes it
// (vdi.write); Data is carried raw after the JSON, at most MaxData bytes.
type VDIWriteRequest struct {
	Name   string `json:"name,omitempty"`
	Offset int64  `json:"offset,omitempty"`
	Data   []byte `json:"-"`
}

// VDIWriteReply is vdi.write's reply.
type VDIWriteReply struct {
	Written int64 `json:"written"`
}

func (r VDIReadReply) rawData() []byte      { return r.Data }
func (r *VDIReadReply) setRawData(p []byte) { r.Data = p }

func (r VDIWriteRequest) rawData() []byte      { return r.Data }
func (r *VDIWriteRequest) setRawData(p []byte) { r.Data = p }

// LostMarkRequest gives unfound objects up (lost.mark): the one Object
// names, or with All every object some node reports unfound.
type LostMarkRequest struct {
	Object object.ID `json:"object,omitempty"`
	All    bool      `json:"all,omitempty"`
}

// RecoverySetRequest changes a node's recovery (recovery.set); its reply
// is the recovery's stats after the change.
type RecoverySetRequest struct {
	Recovery *RecoveryControl `json:"recovery,omitempty"`
}

// RecoveryControl is `ovis node recovery`'s request: a field left nil
// is left as it is.
type RecoveryControl struct {
	// MaxRate bounds the bytes per second recovery pulls; 0 is no bound.
	MaxRate *int64 `json:"max_rate,omitempty"`
	// Paused stops (true) or resumes (false) the background pulls. A
	// request's own object is still recovered first, paused or not.
	Paused *bool `json:"paused,omitempty"`
}

// ObjectRequest names one object for the repair verbs a node serves for
// itself (object.recover, object.drop, vdi.purge: the object's VDI).
type ObjectRequest struct {
	Object object.ID `json:"object,omitempty"`
}

// ObjectReplaceRequest asks a node to replace its copy of Object with
// the one node Source holds (object.replace).
type ObjectReplaceRequest struct {
	Object object.ID `json:"object,omitempty"`
	Source string    `json:"source,omitempty"`
}

// RecoveryStats is what node list shows of a node's recovery.
type RecoveryStats struct {
	Epoch   uint64 `json:"epoch"`   // the epoch being (or last) recovered
	Done    uint64 `json:"done"`    // the last epoch completely recovered
	Listed  bool   `json:"listed"`  // the listing of Epoch is complete
	Pending int    `json:"pending"` // objects still to recover
	// Unfound counts the objects placed here whose newest copy may be on
	// nodes that are away (UnfoundOn): nobody serves them until one
	// returns. UnfoundObjects names some of them.
	Unfound        int      `json:"unfound"`
	UnfoundOn      []string `json:"unfound_on,omitempty"`
	UnfoundObjects []string `json:"unfound_objects,omitempty"`
	Recovered      int64    `json:"recovered"` // objects recovered in this run
	Bytes          int64    `json:"bytes"`     // bytes pulled in this run
	Dropped        int64    `json:"dropped"`   // copies dropped in this run
	// Verified counts the copies of a lower rank at their source's
	// version that a checksum of each found equal, and that were kept
	// instead of pulled, in this run (recovery.Step.Verify).
	Verified int64  `json:"verified"`
	Clean    uint64 `json:"clean"`    // the last epoch after whose recovery every moved copy was dropped
	Paused   bool   `json:"paused"`   // background pulls paused
	MaxRate  int64  `json:"max_rate"` // bytes per second, 0 for no bound
}

// NodeStatus is one node as `ovis node list` shows it (node.self,
// node.list).
type NodeStatus struct {
	ID        string `json:"id"`
	Addr      string `json:"addr"`
	Zone      uint32 `json:"zone"`
	Weight    uint32 `json:"weight"`
	State     string `json:"state"`
	Epoch     uint64 `json:"epoch"`
	Objects   int    `json:"objects"`
	Allocated int64  `json:"used"`
	Free      int64  `json:"free"`
	// Recovery is the node's recovery progress.
	Recovery RecoveryStats `json:"recovery"`
	Error    string        `json:"error,omitempty"`
}

// RecoveryState says in a few words where a node's recovery stands.
func (s NodeStatus) RecoveryState() string {
	r := s.Recovery
	switch {
	case r.Done >= s.Epoch:
		return "done"
	case !r.Listed:
		return "listing"
	case r.Unfound > 0 && r.Pending > 0:
		return fmt.Sprintf("%d left, %d unfound (on %s)", r.Pending, r.Unfound, strings.Join(r.UnfoundOn, ","))
	case r.Unfound > 0:
		return fmt.Sprintf("%d unfound (on %s)", r.Unfound, strings.Join(r.UnfoundOn, ","))
	}
	return fmt.Sprintf("%d left", r.Pending)
}

// Info is what `ovis cluster info` shows (info).
type Info struct {
	Node    string                `json:"node"`
	Etcd    []string              `json:"etcd"`
	Format  *membership.Format    `json:"format,omitempty"`
	Epoch   uint64                `json:"epoch"`
	Nodes   []membership.NodeInfo `json:"nodes"`
	History []membership.View     `json:"history"`
	// Unfound counts the objects the nodes report unfound (their newest
	// copy may be on nodes that are away: nobody serves them), and
	// UnfoundOn the nodes they may be on.
	Unfound   int      `json:"unfound"`
	UnfoundOn []string `json:"unfound_on,omitempty"`
	// Unreachable is, per node, the peers of the current epoch it
	// reports it cannot reach (membership.Client.Reports): a node cut
	// off from its peers leaves the epoch by the reachability rule.
	Unreachable map[string][]string `json:"unreachable,omitempty"`
	// Full are the nodes of the current epoch out of placement for a
	// full disk (membership.NodeInfo.Full).
	Full []string `json:"full,omitempty"`
}

// CheckReport is what `ovis cluster check` finds (check).
type CheckReport struct {
	Objects int           `json:"objects"`
	Copies  int           `json:"copies"`
	Bad     []CheckResult `json:"problems,omitempty"`
	// VDIs are the VDIs the check knew, for a check again after repair.
	VDIs []membership.VDI `json:"-"`
}

// CheckResult is one object with a missing, extra or diverging copy.
type CheckResult struct {
	VDI     string   `json:"vdi"`
	Object  string   `json:"object"`
	Problem string   `json:"problem"`
	Nodes   []string `json:"nodes,omitempty"`
	// Kind is the problem in one word, for repair: missing, differ,
	// extra, orphan, absent, unfound or error.
	Kind string `json:"kind"`
	// Groups are the copies of a differ, one per distinct checksum.
	Groups []CheckGroup `json:"groups,omitempty"`
}

// CheckGroup is the copies of an object that share one checksum.
type CheckGroup struct {
	CRC     uint32   `json:"crc"`
	Version uint64   `json:"version"` // the highest among them
	Nodes   []string `json:"nodes"`
}

// UnfoundObject is an object a node's recovery found unfound, and the
// nodes that may hold its newest copy (recovery.unfound, lost.mark).
type UnfoundObject struct {
	Object string   `json:"object"`
	VDI    string   `json:"vdi,omitempty"`
	On     []string `json:"may_be_on"`
	// Epoch is the epoch of a mark-lost: the object's copies unfound up
	// to it are given up.
	Epoch uint64 `json:"epoch,omitempty"`
}

// AllocChunk is one chunk of a VDI's allocation map as vdi.allocated
// returns it (object.Set.ChunkBytes).
type AllocChunk struct {
	Chunk uint32 `json:"chunk"`
	Bits  []byte `json:"bits"`
}

// Chunks encodes s for vdi.allocated's reply; the slice is the caller's.
func Chunks(s *object.Set) []AllocChunk {
	out := []AllocChunk{}
	for _, c := range s.Chunks() {
		out = append(out, AllocChunk{Chunk: c, Bits: s.ChunkBytes(c)})
	}
	return out
}

// SetOf decodes vdi.allocated's reply. It returns the error of a chunk
// whose bits are malformed.
func SetOf(chunks []AllocChunk) (*object.Set, error) {
	var s object.Set
	for _, c := range chunks {
		if err := s.AddChunkBytes(c.Chunk, c.Bits); err != nil {
			return nil, fmt.Errorf("admin: allocation chunk %d: %w", c.Chunk, err)
		}
	}
	return &s, nil
}
