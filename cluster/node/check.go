package node

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// Check compares every copy of every object the nodes of v hold: each
// object of a VDI in vdis must be on exactly its replicas in v (for its
// copies in v's epoch: vdis must be read after v), with equal
// checksums. It reports missing copies, copies that differ, copies
// on nodes that should not hold them and objects of no VDI. For a VDI
// that keeps an allocation map (VDI.Allocation), read with allocated,
// it also reports each object in the map that no node of v holds
// (kind "absent"): written once, and now lost or on nodes that are
// away. progress, when not nil, is called as objects are done (done of
// total). net reaches the nodes (protocol.Pool, or a node's own
// caller).
func Check(ctx context.Context, net gateway.Caller, v *gateway.View, vdis []membership.VDI, allocated Allocated, progress func(done, total int)) (*CheckReport, error) {
	ids := make([]string, 0, len(v.Addr))
	for id := range v.Addr {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	// Who holds what, from every node's list.
	held := map[object.ID][]string{}
	for _, id := range ids {
		infos, err := listAll(ctx, net, v, id, 0)
		if err != nil {
			return nil, err
		}
		for _, in := range infos {
			held[in.ID] = append(held[in.ID], id)
		}
	}
	byID := map[object.VDI]membership.VDI{}
	for _, vd := range vdis {
		byID[vd.ID] = vd
	}
	objs := make([]object.ID, 0, len(held))
	for o := range held {
		objs = append(objs, o)
	}
	slices.Sort(objs)

	results := make([][]CheckResult, len(objs))
	copies := make([]int, len(objs))
	errs := make([]error, len(objs))
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		done int
	)
	work := make(chan int)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				results[i], copies[i], errs[i] = checkObject(ctx, net, v, byID, objs[i], held[objs[i]])
				if progress != nil {
					mu.Lock()
					done++
					progress(done, len(objs))
					mu.Unlock()
				}
			}
		}()
	}
	for i := range objs {
		work <- i
	}
	close(work)
	wg.Wait()
	rep := &CheckReport{}
	for _, vd := range vdis {
		if !vd.Allocation || allocated == nil {
			continue
		}
		s, err := allocated(ctx, vd)
		if err != nil {
			return nil, fmt.Errorf("check: vdi %s: %w", vd.Name, err)
		}
		n := (vd.Size + vd.ObjectSize() - 1) / vd.ObjectSize()
		s.Each(func(i uint32) {
			o := object.Make(vd.ID, i)
			if int64(i) >= n || len(held[o]) > 0 {
				return
			}
			rep.Objects++
			rep.Bad = append(rep.Bad, CheckResult{VDI: vd.Name, Object: o.String(), Kind: "absent",
				Problem: "written (in the VDI's allocation map), and no node that is up holds a copy: lost, or its holders are away"})
		})
	}
	for i := range objs {
		if errs[i] != nil {
			return nil, errs[i]
		}
		if _, ok := byID[objs[i].VDI()]; ok {
			rep.Objects++
		}
		rep.Copies += copies[i]
		rep.Bad = append(rep.Bad, results[i]...)
	}
	return rep, nil
}

// Allocated reads a VDI's allocation map (membership.Client.Allocated,
// or the admin command vdi.allocated through a node).
type Allocated func(ctx context.Context, vd membership.VDI) (*object.Set, error)

// AllocChunk is one chunk of an allocation map as the admin command
// vdi.allocated returns it (object.Set.ChunkBytes).
type AllocChunk struct {
	Chunk uint32 `json:"chunk"`
	Bits  []byte `json:"bits"`
}

// allocChunks encodes s for the admin command.
func allocChunks(s *object.Set) []AllocChunk {
	out := []AllocChunk{}
	for _, c := range s.Chunks() {
		out = append(out, AllocChunk{Chunk: c, Bits: s.ChunkBytes(c)})
	}
	return out
}

// SetOf decodes what the admin command vdi.allocated returns.
func SetOf(chunks []AllocChunk) (*object.Set, error) {
	var s object.Set
	for _, c := range chunks {
		if err := s.AddChunkBytes(c.Chunk, c.Bits); err != nil {
			return nil, err
		}
	}
	return &s, nil
}

// listAll lists the objects of vdi (0: every VDI) node id holds, page by
// page.
func listAll(ctx context.Context, net gateway.Caller, v *gateway.View, id string, vdi object.VDI) ([]protocol.ObjectInfo, error) {
	var all []protocol.ObjectInfo
	for cursor := uint64(0); ; {
		var resp protocol.Response
		req := &protocol.Request{Op: protocol.OpList, Epoch: v.Epoch, Object: object.Make(vdi, 0), Offset: cursor, Length: listPage}
		if err := net.Call(ctx, v.Addr[id], req, &resp); err != nil {
			return nil, fmt.Errorf("listing node %s: %w", id, err)
		}
		page, err := protocol.ParseObjectInfos(nil, resp.Payload)
		if err != nil {
			return nil, fmt.Errorf("listing node %s: %w", id, err)
		}
		all = append(all, page...)
		if len(page) < int(req.Length) {
			return all, nil
		}
		cursor = uint64(page[len(page)-1].ID) + 1
	}
}

// checkObject compares the copies of one object.
func checkObject(ctx context.Context, net gateway.Caller, v *gateway.View, byID map[object.VDI]membership.VDI, o object.ID, holders []string) ([]CheckResult, int, error) {
	vd, ok := byID[o.VDI()]
	if !ok {
		return []CheckResult{{Object: o.String(), Problem: "object of no VDI (deleted?)", Nodes: holders, Kind: "orphan"}}, 0, nil
	}
	// The copies of v's epoch: vdis were read after v was (VDI.CopiesAt).
	c, _ := vd.CopiesAt(v.Epoch)
	n := min(c, v.Map.Zones())
	want, err := v.Map.Place(o, n, nil)
	if err != nil {
		return nil, 0, err
	}
	var bad []CheckResult
	var missing []string
	sums := map[uint32][]string{}
	vers := map[uint32]uint64{}
	compared := 0
	for _, id := range want {
		if !slices.Contains(holders, id) {
			missing = append(missing, id)
			continue
		}
		var resp protocol.Response
		req := protocol.Request{Op: protocol.OpChecksum, Epoch: v.Epoch, Object: o, Length: protocol.MaxObjectSpan}
		err := net.Call(ctx, v.Addr[id], &req, &resp)
		// A copy withheld by a gate (a write not settled yet, or a
		// pulled copy its peers do not have yet) is asked again a few
		// times: gates go within a second or so once writes stop.
		for try := 0; protocol.StatusOf(err) == protocol.StatusSuspect && try < 8; try++ {
			select {
			case <-ctx.Done():
				return nil, 0, ctx.Err()
			case <-time.After(300 * time.Millisecond):
			}
			err = net.Call(ctx, v.Addr[id], &req, &resp)
		}
		if err != nil {
			bad = append(bad, CheckResult{VDI: vd.Name, Object: o.String(), Problem: "checksum failed: " + err.Error(), Nodes: []string{id}, Kind: "error"})
			continue
		}
		crc, ver, err := protocol.ParseChecksumReply(resp.Payload)
		if err != nil {
			return nil, 0, err
		}
		sums[crc] = append(sums[crc], id)
		vers[crc] = max(vers[crc], ver)
		compared++
	}
	if len(missing) > 0 {
		bad = append(bad, CheckResult{VDI: vd.Name, Object: o.String(), Problem: fmt.Sprintf("%d of %d copies missing", len(missing), n), Nodes: missing, Kind: "missing"})
	}
	if len(sums) > 1 {
		var groups []string
		var gs []CheckGroup
		for crc, nodes := range sums {
			groups = append(groups, fmt.Sprintf("%08x on %v", crc, nodes))
			gs = append(gs, CheckGroup{CRC: crc, Version: vers[crc], Nodes: nodes})
		}
		slices.Sort(groups)
		slices.SortFunc(gs, func(a, b CheckGroup) int { return cmp.Compare(a.CRC, b.CRC) })
		bad = append(bad, CheckResult{VDI: vd.Name, Object: o.String(), Problem: "copies differ: " + fmt.Sprint(groups), Kind: "differ", Groups: gs})
	}
	for _, id := range holders {
		if !slices.Contains(want, id) {
			bad = append(bad, CheckResult{VDI: vd.Name, Object: o.String(), Problem: "extra copy on a node that should not hold it", Nodes: []string{id}, Kind: "extra"})
		}
	}
	return bad, compared, nil
}

// listPage is how many objects one OpList of Check asks for.
var listPage uint32 = 1 << 16

// Unfound returns a check problem (kind "unfound") for each object some
// node of nodes reports unfound: placed on it, with its newest copy
// possibly on nodes that are away, so that nobody serves it. A check
// compares the copies it finds; an object whose every holder is away is
// in no listing, and only the recovery of the nodes placed for it knows
// of it. A node that names fewer objects than it counts adds one problem
// for the rest. vdis names the VDIs.
func Unfound(nodes []NodeStatus, vdis []membership.VDI) []CheckResult {
	names := map[object.VDI]string{}
	for _, vd := range vdis {
		names[vd.ID] = vd.Name
	}
	var out []CheckResult
	seen := map[string]bool{}
	for _, n := range nodes {
		r := n.Recovery
		if n.State != "up" || r.Unfound == 0 {
			continue
		}
		for _, o := range r.UnfoundObjects {
			if seen[o] {
				continue
			}
			seen[o] = true
			name := "?"
			if id, err := object.Parse(o); err == nil {
				name = names[id.VDI()]
			}
			out = append(out, CheckResult{VDI: name, Object: o, Kind: "unfound", Nodes: r.UnfoundOn,
				Problem: "unfound: its newest copy may be on nodes that are away; nobody serves it until one returns:"})
		}
		if more := r.Unfound - len(r.UnfoundObjects); more > 0 {
			out = append(out, CheckResult{VDI: "-", Object: "-", Kind: "unfound", Nodes: r.UnfoundOn,
				Problem: fmt.Sprintf("%d more objects unfound on node %s; they may be on:", more, n.ID)})
		}
	}
	return out
}
