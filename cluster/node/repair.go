package node

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/recovery"
	"github.com/ovis-storage/ovis/cluster/view"
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
func Repair(ctx context.Context, net gateway.Caller, v *view.View, rep *admin.CheckReport) ([]string, error) {
	var done []string
	say := func(b admin.CheckResult, format string, args ...any) {
		done = append(done, fmt.Sprintf("vdi %s object %s: %s", b.VDI, b.Object, fmt.Sprintf(format, args...)))
	}
	// to is the admin client of a node of v.
	to := func(node string) (*admin.Client, error) {
		addr := v.Addr[node]
		if addr == "" {
			return nil, fmt.Errorf("node %s is not in epoch %d", node, v.Epoch)
		}
		return admin.Via(net, addr), nil
	}
	for _, b := range rep.Bad {
		id, err := object.Parse(b.Object)
		if err != nil {
			return done, fmt.Errorf("repair: %w", err)
		}
		// ask sends one of the repair verbs of an object to a node.
		ask := func(node string, k admin.Call[admin.ObjectRequest, admin.Ack]) error {
			c, err := to(node)
			if err == nil {
				_, err = k.Do(ctx, c, admin.ObjectRequest{Object: id})
			}
			return err
		}
		switch b.Kind {
		case "missing":
			for _, n := range b.Nodes {
				if err := ask(n, admin.ObjectRecover); err != nil {
					say(b, "not recovered on %s: %v", n, err)
					continue
				}
				say(b, "copied to %s (it was missing)", n)
			}
		case "differ":
			g := slices.Clone(b.Groups)
			slices.SortFunc(g, func(x, y admin.CheckGroup) int {
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
					c, err := to(n)
					if err == nil {
						_, err = admin.ObjectReplace.Do(ctx, c, admin.ObjectReplaceRequest{Object: id, Source: src})
					}
					if err != nil {
						say(b, "copy on %s not replaced: %v", n, err)
						continue
					}
					say(b, "copy on %s (crc %08x) replaced by the one on %s (crc %08x, held by %d)", n, lost.CRC, src, g[0].CRC, len(g[0].Nodes))
				}
			}
		case "extra":
			for _, n := range b.Nodes {
				if err := ask(n, admin.ObjectDrop); err != nil {
					say(b, "extra copy on %s kept: %v", n, err)
					continue
				}
				say(b, "extra copy on %s dropped", n)
			}
		case "orphan":
			for _, n := range b.Nodes {
				if err := ask(n, admin.VDIPurge); err != nil {
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

// recoverObject serves object.recover: this node recovers obj on
// demand, the newest copy winning as in recovery.
func (n *Node) recoverObject(ctx context.Context, obj object.ID) (admin.Ack, error) {
	if err := named(admin.ObjectRecover.Verb, obj); err != nil {
		return "", err
	}
	if err := n.rec.now(ctx, n.views.View(), obj, true); err != nil {
		return "", err
	}
	return "recovered", nil
}

// replaceObject serves object.replace: this node's copy of obj is
// replaced by the one node source holds, whatever their versions.
func (n *Node) replaceObject(ctx context.Context, obj object.ID, source string) (admin.Ack, error) {
	if err := named(admin.ObjectReplace.Verb, obj); err != nil {
		return "", err
	}
	if source == "" || source == n.id {
		return "", fmt.Errorf("object %s: replace from %q: name another node", obj, source)
	}
	data, ver, err := n.rec.fetch(ctx, n.views.View(), obj, recovery.Step{Action: recovery.Pull, Source: source})
	if err != nil {
		return "", err
	}
	if err := n.st.Replace(obj, ver, data); err != nil {
		return "", fmt.Errorf("object %s: %w", obj, err)
	}
	return "replaced", nil
}

// dropObject serves object.drop: this node drops its extra copy of obj,
// once every replica of obj holds a copy at least as new.
func (n *Node) dropObject(ctx context.Context, obj object.ID) (admin.Ack, error) {
	if err := named(admin.ObjectDrop.Verb, obj); err != nil {
		return "", err
	}
	v := n.views.View()
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
}

// purgeVDI serves vdi.purge: this node removes every object of obj's
// VDI, which must be deleted.
func (n *Node) purgeVDI(ctx context.Context, obj object.ID) (admin.Ack, error) {
	if err := named(admin.VDIPurge.Verb, obj); err != nil {
		return "", err
	}
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

// named refuses a repair verb that names no object.
func named(verb admin.Verb, obj object.ID) error {
	if obj.VDI() == 0 {
		return fmt.Errorf("%s: no object named", verb)
	}
	return nil
}
