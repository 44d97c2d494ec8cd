package node

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/recovery"
)

// Repair fixes what a Check found, by asking the nodes concerned, and
// returns one line per action taken (and per problem it left):
//
//   - a missing copy: its node recovers the object on demand (the newest
//     copy wins, as in recovery);
//   - copies that differ: the group held by most nodes wins, then the
//     one with the highest version, then the one holding the lowest node
//     ID; every other replica replaces its copy with the winner's;
//   - an extra copy: its node drops it, once every replica of the object
//     holds a copy at least as new;
//   - an object of no VDI: its node removes the deleted VDI's objects.
//
// Run Check again afterwards to see the result.
func Repair(ctx context.Context, net gateway.Caller, v *gateway.View, rep *CheckReport) ([]string, error) {
	var done []string
	say := func(b CheckResult, format string, args ...any) {
		done = append(done, fmt.Sprintf("vdi %s object %s: %s", b.VDI, b.Object, fmt.Sprintf(format, args...)))
	}
	for _, b := range rep.Bad {
		id, err := object.Parse(b.Object)
		if err != nil {
			return done, fmt.Errorf("repair: %w", err)
		}
		ask := func(node, cmd, source string) error {
			addr := v.Addr[node]
			if addr == "" {
				return fmt.Errorf("node %s is not in epoch %d", node, v.Epoch)
			}
			var msg string
			return adminVia(ctx, net, addr, AdminRequest{Cmd: cmd, Object: uint64(id), Source: source}, &msg)
		}
		switch b.Kind {
		case "missing":
			for _, n := range b.Nodes {
				if err := ask(n, "object.recover", ""); err != nil {
					say(b, "not recovered on %s: %v", n, err)
					continue
				}
				say(b, "copied to %s (it was missing)", n)
			}
		case "differ":
			g := slices.Clone(b.Groups)
			slices.SortFunc(g, func(x, y CheckGroup) int {
				if c := cmp.Compare(len(y.Nodes), len(x.Nodes)); c != 0 {
					return c
				}
				if c := cmp.Compare(y.Version, x.Version); c != 0 {
					return c
				}
				return cmp.Compare(slices.Min(x.Nodes), slices.Min(y.Nodes))
			})
			src := slices.Min(g[0].Nodes)
			for _, lost := range g[1:] {
				for _, n := range lost.Nodes {
					if err := ask(n, "object.replace", src); err != nil {
						say(b, "copy on %s not replaced: %v", n, err)
						continue
					}
					say(b, "copy on %s (crc %08x) replaced by the one on %s (crc %08x, held by %d)", n, lost.CRC, src, g[0].CRC, len(g[0].Nodes))
				}
			}
		case "extra":
			for _, n := range b.Nodes {
				if err := ask(n, "object.drop", ""); err != nil {
					say(b, "extra copy on %s kept: %v", n, err)
					continue
				}
				say(b, "extra copy on %s dropped", n)
			}
		case "orphan":
			for _, n := range b.Nodes {
				if err := ask(n, "vdi.purge", ""); err != nil {
					say(b, "objects of the deleted VDI kept on %s: %v", n, err)
					continue
				}
				say(b, "objects of the deleted VDI removed from %s", n)
			}
		default:
			say(b, "left as it is: %s", b.Problem)
		}
	}
	return done, nil
}

// adminVia sends one admin command to the node at addr through net; a
// refusal comes back as the node worded it.
func adminVia(ctx context.Context, net gateway.Caller, addr string, ar AdminRequest, out any) error {
	_, err := callAdmin(ctx, net, addr, ar, nil, out, func(err error) error {
		var pe *protocol.Error
		if errors.As(err, &pe) {
			return errors.New(pe.Msg)
		}
		return err
	})
	return err
}

// repairCmd serves the repair commands on this node.
func (n *Node) repairCmd(ctx context.Context, ar AdminRequest) (string, error) {
	obj := object.ID(ar.Object)
	if obj.VDI() == 0 {
		return "", fmt.Errorf("%s: no object named", ar.Cmd)
	}
	v := n.views.View()
	switch ar.Cmd {
	case "object.recover":
		if err := n.rec.now(ctx, v, obj); err != nil {
			return "", err
		}
		return "recovered", nil
	case "object.replace":
		if ar.Source == "" || ar.Source == n.id {
			return "", fmt.Errorf("object %s: replace from %q: name another node", obj, ar.Source)
		}
		data, ver, err := n.rec.fetch(ctx, v, obj, recovery.Step{Action: recovery.Pull, Source: ar.Source})
		if err != nil {
			return "", err
		}
		if err := n.st.Replace(obj, ver, data); err != nil {
			return "", fmt.Errorf("object %s: %w", obj, err)
		}
		return "replaced", nil
	case "object.drop":
		reps, err := n.rec.replicas(ctx, v, obj)
		if err != nil {
			return "", err
		}
		if slices.Contains(reps, n.id) {
			return "", fmt.Errorf("object %s: this node is one of its replicas in epoch %d; not dropping", obj, v.Epoch)
		}
		own, err := n.st.Stat(obj)
		if err != nil {
			return "", fmt.Errorf("object %s: %w", obj, err)
		}
		copies, err := n.rec.statAll(ctx, v, obj)
		if err != nil {
			return "", err
		}
		for _, r := range reps {
			i := slices.IndexFunc(copies, func(c recovery.Copy) bool { return c.Node == r })
			if i < 0 || copies[i].Suspect || copies[i].Version < own.Version {
				return "", fmt.Errorf("object %s: replica %s does not hold a copy as new as this one yet; not dropping", obj, r)
			}
		}
		if err := dropCopy(n.st, obj); err != nil {
			return "", err
		}
		return "dropped", nil
	case "vdi.purge":
		if _, err := n.mc.GetVDIByID(ctx, obj.VDI()); !errors.Is(err, membership.ErrNoVDI) {
			if err == nil {
				return "", fmt.Errorf("vdi %08x exists; not purging", uint32(obj.VDI()))
			}
			return "", err
		}
		if err := n.st.RemoveVDI(obj.VDI(), n.st.Token(obj.VDI())); err != nil {
			return "", err
		}
		return "purged", nil
	}
	return "", fmt.Errorf("unknown repair command %q", ar.Cmd)
}
