package node

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/view"
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
func Check(ctx context.Context, net gateway.Caller, v *view.View, vdis []membership.VDI, allocated Allocated, progress func(done, total int)) (*admin.CheckReport, error) {
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

	results := make([][]admin.CheckResult, len(objs))
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
	rep := &admin.CheckReport{}
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
			rep.Bad = append(rep.Bad, admin.CheckResult{VDI: vd.Name, Object: o.String(), Kind: "absent",
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
// or AllocatedVia a node).
type Allocated func(ctx context.Context, vd membership.VDI) (*object.Set, error)

// AllocatedVia reads allocation maps through the node c reaches (the
// admin verb vdi.allocated).
func AllocatedVia(c *admin.Client) Allocated {
	return func(ctx context.Context, vd membership.VDI) (*object.Set, error) {
		chunks, err := admin.VDIAllocated.Do(ctx, c, admin.NameRequest{Name: vd.Name})
		if err != nil {
			return nil, fmt.Errorf("allocation map of vdi %s: %w", vd.Name, err)
		}
		return admin.SetOf(chunks)
	}
}

// CheckVia is `ovis cluster check` run from outside the cluster: it
// learns the epoch and the VDIs from the node c reaches, compares every
// copy through net itself (Check, with progress), and adds the objects
// the nodes report unfound (Unfound), which no listing has. With repair,
// and problems found, it repairs them (Repair) and checks again;
// repaired says what it did. Unfound objects are left as they are
// by repair: only a holder's return settles them.
func CheckVia(ctx context.Context, c *admin.Client, net gateway.Caller, repair bool, progress func(done, total int)) (_ *admin.CheckReport, repaired []string, _ error) {
	info, err := admin.GetInfo.Do(ctx, c, admin.None{})
	if err != nil {
		return nil, nil, err
	}
	vdis, err := admin.VDIList.Do(ctx, c, admin.None{})
	if err != nil {
		return nil, nil, err
	}
	v, err := ViewOf(membership.View{Epoch: info.Epoch, Nodes: info.Nodes})
	if err != nil {
		return nil, nil, err
	}
	r, err := Check(ctx, net, v, vdis, AllocatedVia(c), progress)
	if err != nil {
		return nil, nil, err
	}
	r.VDIs = vdis
	// Objects whose every holder is away are in no listing: the nodes
	// placed for them say so, and say who may hold them, which says
	// more than the allocation map's "absent".
	nodes, err := admin.NodeList.Do(ctx, c, admin.None{})
	if err != nil {
		return nil, nil, err
	}
	unfound := Unfound(nodes, vdis)
	r.Bad = slices.DeleteFunc(r.Bad, func(b admin.CheckResult) bool {
		return b.Kind == "absent" && slices.ContainsFunc(unfound, func(u admin.CheckResult) bool { return u.Object == b.Object })
	})
	r.Bad = append(r.Bad, unfound...)
	if !repair || len(r.Bad) == 0 {
		return r, nil, nil
	}
	if repaired, err = Repair(ctx, net, v, r); err != nil {
		return nil, repaired, err
	}
	again, err := Check(ctx, net, v, vdis, AllocatedVia(c), nil)
	if err != nil {
		return nil, repaired, err
	}
	again.VDIs = vdis
	for _, b := range r.Bad {
		if b.Kind == "unfound" {
			again.Bad = append(again.Bad, b)
		}
	}
	return again, repaired, nil
}

// listAll lists the objects of vdi (0: every VDI) node id holds, page by
// page.
func listAll(ctx context.Context, net gateway.Caller, v *view.View, id string, vdi object.VDI) ([]protocol.ObjectInfo, error) {
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
func checkObject(ctx context.Context, net gateway.Caller, v *view.View, byID map[object.VDI]membership.VDI, o object.ID, holders []string) ([]admin.CheckResult, int, error) {
	vd, ok := byID[o.VDI()]
	if !ok {
		return []admin.CheckResult{{Object: o.String(), Problem: "object of no VDI (deleted?)", Nodes: holders, Kind: "orphan"}}, 0, nil
	}
	// The copies of v's epoch: vdis were read after v was (VDI.CopiesAt).
	c, _ := vd.CopiesAt(v.Epoch)
	n := min(c, v.Map.Zones())
	want, err := v.Map.Place(o, n, nil)
	if err != nil {
		return nil, 0, err
	}
	var bad []admin.CheckResult
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
			bad = append(bad, admin.CheckResult{VDI: vd.Name, Object: o.String(), Problem: "checksum failed: " + err.Error(), Nodes: []string{id}, Kind: "error"})
			if protocol.StatusOf(err) != protocol.StatusSuspect {
				continue
			}
			// Still withheld: the copy as it is goes into the
			// comparison, so that the report says whether the copies
			// differ (a hide that stays while they agree is a fault of
			// its own).
			req.Flags |= protocol.FlagRecovery
			resp = protocol.Response{}
			if err = net.Call(ctx, v.Addr[id], &req, &resp); err != nil {
				continue
			}
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
		bad = append(bad, admin.CheckResult{VDI: vd.Name, Object: o.String(), Problem: fmt.Sprintf("%d of %d copies missing", len(missing), n), Nodes: missing, Kind: "missing"})
	}
	if len(sums) > 1 {
		var groups []string
		var gs []admin.CheckGroup
		for crc, nodes := range sums {
			groups = append(groups, fmt.Sprintf("%08x on %v", crc, nodes))
			gs = append(gs, admin.CheckGroup{CRC: crc, Version: vers[crc], Nodes: nodes})
		}
		slices.Sort(groups)
		slices.SortFunc(gs, func(a, b admin.CheckGroup) int { return cmp.Compare(a.CRC, b.CRC) })
		bad = append(bad, admin.CheckResult{VDI: vd.Name, Object: o.String(), Problem: "copies differ: " + fmt.Sprint(groups), Kind: "differ", Groups: gs})
	}
	for _, id := range holders {
		if !slices.Contains(want, id) {
			bad = append(bad, admin.CheckResult{VDI: vd.Name, Object: o.String(), Problem: "extra copy on a node that should not hold it", Nodes: []string{id}, Kind: "extra"})
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
func Unfound(nodes []admin.NodeStatus, vdis []membership.VDI) []admin.CheckResult {
	names := map[object.VDI]string{}
	for _, vd := range vdis {
		names[vd.ID] = vd.Name
	}
	var out []admin.CheckResult
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
			out = append(out, admin.CheckResult{VDI: name, Object: o, Kind: "unfound", Nodes: r.UnfoundOn,
				Problem: "unfound: its newest copy may be on nodes that are away; nobody serves it until one returns:"})
		}
		if more := r.Unfound - len(r.UnfoundObjects); more > 0 {
			out = append(out, admin.CheckResult{VDI: "-", Object: "-", Kind: "unfound", Nodes: r.UnfoundOn,
				Problem: fmt.Sprintf("%d more objects unfound on node %s; they may be on:", more, n.ID)})
		}
	}
	return out
}
